from __future__ import annotations

import pytest
import torch

from weightsync.api.config import BUCKET_ALIGNMENT
from weightsync.api.errors import DuplicateTensorError, UnsupportedDeviceError, UnsupportedDtypeError, WeightStreamError
from weightsync.core.planner import plan_buckets

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
