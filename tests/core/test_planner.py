from __future__ import annotations

import pytest
import torch

from weightsync.api.config import BUCKET_ALIGNMENT
from weightsync.api.errors import DuplicateTensorError, UnsupportedDeviceError, UnsupportedDtypeError, WeightStreamError
from weightsync.core.pipeline.planner import plan_buckets
from weightsync.core.wire.layout import PIECE_BYTES

CPU = frozenset({"cpu"})


def plan(weights: list[tuple[str, torch.Tensor]], bucket_bytes: int = 4096) -> list[list[tuple[str, int, int, int]]]:
    return [[(meta.name, meta.offset, meta.nbytes, meta.bucket_offset) for meta, _, _ in bucket.items]
            for bucket in plan_buckets(weights, bucket_bytes=bucket_bytes, devices=CPU)]


def test_tensors_are_aligned_and_packed_in_order() -> None:
    buckets = plan([("a", torch.zeros(10)), ("b", torch.zeros(3, dtype=torch.int8)), ("c", torch.zeros(5))])
    assert buckets == [[("a", 0, 40, 0), ("b", 0, 3, BUCKET_ALIGNMENT), ("c", 0, 20, 2 * BUCKET_ALIGNMENT)]]


def test_a_tensor_that_fits_a_fresh_bucket_is_not_split() -> None:
    buckets = plan([("a", torch.zeros(600)), ("b", torch.zeros(600))])  # 2400 bytes each, 4096-byte buckets
    assert buckets == [[("a", 0, 2400, 0)], [("b", 0, 2400, 0)]]


def test_a_tensor_larger_than_a_bucket_is_split_into_ranges() -> None:
    buckets = plan([("small", torch.zeros(16)), ("big", torch.zeros(3000))])  # 12000 bytes
    big = [entry for bucket in buckets for entry in bucket if entry[0] == "big"]
    assert [(offset, nbytes) for _, offset, nbytes, _ in big] == [(0, 4096 - 256), (3840, 4096), (7936, 4064)]
    assert sum(nbytes for _, _, nbytes, _ in big) == 12000


def test_zero_size_tensors_are_carried() -> None:
    assert plan([("empty", torch.empty(0, 3)), ("x", torch.zeros(1))]) == [[("empty", 0, 0, 0), ("x", 0, 4, 0)]]


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        ([("a", torch.zeros(1)), ("a", torch.zeros(1))], DuplicateTensorError, "twice"),
        ([("a", [1, 2])], WeightStreamError, "not a tensor"),
        ([("a", torch.zeros(1), 3)], WeightStreamError, "pairs"),
        ([("", torch.zeros(1))], WeightStreamError, "non-empty"),
        ([("\udcff", torch.zeros(1))], WeightStreamError, "UTF-8"),
        ([("x" * 2000, torch.zeros(1))], WeightStreamError, "limit"),
        ([("a", torch.zeros(2, 2).to_sparse())], UnsupportedDtypeError, "layout"),
        ([("a", torch.zeros(1, device="meta"))], UnsupportedDeviceError, "meta"),
    ],
)
def test_bad_streams_are_rejected_before_packing(weights: list[object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        list(plan_buckets(weights, bucket_bytes=4096, devices=CPU))


def test_every_piece_is_either_batched_or_streamed_once() -> None:
    # Small pieces become (bucket offset, source address, nbytes) triples for one batched copy; larger ones are
    # streamed item by item. Together they cover each bucket's items exactly once, at the items' own addresses.
    big = 3 * PIECE_BYTES + 100  # split across two buckets of 2 * PIECE_BYTES, both pieces larger than a piece
    weights = [("a", torch.zeros(10)), ("big", torch.zeros(big, dtype=torch.uint8)), ("b", torch.zeros(3)),
               ("huge", torch.zeros(PIECE_BYTES + 1, dtype=torch.uint8))]
    sources = dict(weights)
    buckets = list(plan_buckets(weights, bucket_bytes=2 * PIECE_BYTES, devices=CPU))
    for bucket in buckets:
        copies = bucket.copies
        triples = [(copies[index], copies[index + 1], copies[index + 2]) for index in range(0, len(copies), 3)]
        streamed = [(meta.bucket_offset, source.data_ptr() + start, meta.nbytes)
                    for meta, source, start in bucket.large]
        expected = [(meta.bucket_offset, sources[meta.name].data_ptr() + meta.offset, meta.nbytes)
                    for meta, _, _ in bucket.items]
        assert sorted(triples + streamed) == sorted(expected)
        assert all(nbytes <= PIECE_BYTES for _, _, nbytes in triples)
        assert all(meta.nbytes > PIECE_BYTES for meta, _, _ in bucket.large)
    assert sum(len(bucket.large) for bucket in buckets) == 3  # the two pieces of "big", and "huge"
    assert sum(len(bucket.copies) for bucket in buckets) == 2 * 3  # "a" and "b"
