"""Blocks (``weightsync.core.wire.blocks``): which tensors travel block after block, the rows that pack them and
copy a block back, the full-shape view over a worker's block, and the planner packing them, split or whole, into
buckets whose bytes are each block's row-major bytes one after the other."""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import pytest
import torch

from weightsync.api.errors import PartMismatchError, WireError
from weightsync.api.parts import Part
from weightsync.core.native import copy_batch
from weightsync.core.pipeline.planner import plan_buckets
from weightsync.core.wire import blocks
from weightsync.core.wire.blocks import (BlockPlan, block_copies, block_index, block_packing, block_view, blocks_of,
                                         candidates, check_blocks)
from weightsync.core.wire.codec import TensorMeta, check_tensor_meta, encode_tensors
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.layout import pack_hashing
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.parts import PartLayout, PartsDigest, PartSums

SHAPES = {"q": (64, 32), "o": (32, 64), "down": (32, 128), "norm": (32,), "experts": (4, 24, 16)}
DIMS = {"q": 0, "o": 1, "down": 1, "experts": 1}


def plans(parts: int, dims: dict[str, int] = DIMS) -> list[PartPlan]:
    return [PartPlan.of(Part.split(SHAPES, dims=dims, rank=rank, parts=parts), rank) for rank in range(parts)]


def packed(tensor: torch.Tensor, dim: int, count: int) -> torch.Tensor:
    """What the sender's bytes of ``tensor`` are block after block (the reference, by torch)."""
    return torch.cat([block.contiguous().view(torch.uint8).reshape(-1) for block in tensor.chunk(count, dim)])


def test_candidates_are_the_tensors_every_part_holds_one_block_of_past_the_first_dimension() -> None:
    found = candidates([plan.tensors for plan in plans(2)])
    assert found == {"o": BlockPlan(dim=1, count=2, size=(32, 32)), "down": BlockPlan(dim=1, count=2, size=(32, 64)),
                     "experts": BlockPlan(dim=1, count=2, size=(4, 12, 16))}  # not q (rows lie together), not norm
    assert candidates([plan.tensors for plan in plans(4)])["down"] == BlockPlan(dim=1, count=4, size=(32, 32))
    assert candidates([plans(2)[0].tensors]) == {}  # one part: nothing to separate
    # Overlapping boxes (replicated heads), a part holding nothing or several boxes, unequal widths: not blocks.
    zero, one = (plan.tensors for plan in plans(2))
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"o": [((0, 0), (32, 40))]}, {"o": [((0, 24), (32, 40))]}),  # overlapping
        ({"o": []}, one),  # one part holds nothing of it
        ({"o": [((0, 0), (32, 16)), ((0, 16), (32, 16))]}, one),  # several boxes
        ({"o": [((0, 0), (32, 24))]}, {"o": [((0, 24), (32, 40))]}),  # unequal widths
    ]
    for pair in pairs:
        assert "o" not in candidates(list(pair)), pair
    assert "o" in candidates([zero, one])


def test_blocks_of_checks_the_shape_the_plan_was_made_for() -> None:
    plan = BlockPlan(dim=1, count=2, size=(32, 32))
    assert blocks_of(plan, (32, 64)) == (1, 2)
    assert blocks_of(plan, (32, 66)) is None and blocks_of(plan, (16, 64)) is None and blocks_of(None, (32, 64)) is None
    assert blocks_of(BlockPlan(dim=0, count=2, size=(16, 64)), (32, 64)) is None  # rows lie together already


@pytest.mark.parametrize("shape,dim,count", [((32, 64), 1, 2), ((4, 24, 16), 1, 3), ((6, 8, 10), 2, 2),
                                             ((5, 12), 1, 4)])
def test_rows_pack_any_range_and_copy_each_block_back_where_it_belongs(shape: tuple[int, ...], dim: int,
                                                                       count: int) -> None:
    rng = random.Random(sum(shape))
    tensor = torch.randn(shape, dtype=torch.float32)
    reference = packed(tensor, dim, count)
    total = tensor.nbytes
    cuts = sorted({0, total, *(rng.randrange(total) for _ in range(4))})
    out = torch.zeros(total, dtype=torch.uint8)
    for first, end in zip(cuts, cuts[1:]):  # a tensor split across buckets: each piece packed on its own
        piece = torch.zeros(end - first, dtype=torch.uint8)
        filled: dict[int, int] = {}
        for triples, spans in block_packing(shape, 4, (dim, count), first, end):
            copy_batch(triples, piece.data_ptr(), tensor.data_ptr())
            assert sum(triples[2::3]) == sum(nbytes for _, _, nbytes in spans)
            for block, start, nbytes in spans:  # where each block's rows went, contiguous, after the last group's
                assert filled.get(block, start) == start and 0 <= start and start + nbytes <= end - first
                assert block * total // count <= first + start < (block + 1) * total // count
                filled[block] = start + nbytes
        out[first:end] = piece
    assert out.equal(reference)
    width = shape[dim] // count
    for index in range(count):  # a receiver copies its block's rows into a full-shape destination
        destination = torch.zeros(shape, dtype=torch.float32)
        low, high = index * total // count, (index + 1) * total // count
        for triples, _, _ in block_copies(shape, 4, (dim, count), low, high):
            copy_batch(triples, destination.data_ptr(), reference.data_ptr() + low)
        expected = torch.zeros(shape, dtype=torch.float32)
        expected.narrow(dim, index * width, width).copy_(tensor.narrow(dim, index * width, width))
        assert destination.equal(expected)


@pytest.mark.parametrize("shape,dim,count", [((32, 64), 1, 2), ((4, 24, 16), 1, 3), ((6, 8, 10), 2, 2),
                                             ((3, 4, 6, 8), 2, 2)])
def test_the_full_shape_view_holds_each_workers_block_and_reaches_nowhere_else(shape: tuple[int, ...], dim: int,
                                                                               count: int) -> None:
    tensor = torch.randn(shape)
    data = packed(tensor, dim, count).view(torch.float32)  # exactly the tensor's bytes: as_strided checks bounds
    width = shape[dim] // count
    for index in range(count):
        view = block_view(data, shape, (dim, count), index)
        assert view.shape == shape and view.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
        block = view.narrow(dim, index * width, width)
        assert block.equal(tensor.narrow(dim, index * width, width)) and block.is_contiguous()
        assert tuple(chunk.shape for chunk in view.chunk(count, dim))[index] == block.shape
    # Negative control: the same bytes seen in the tensor's own order are not its blocks.
    assert not data.view(shape).narrow(dim, width, width).equal(tensor.narrow(dim, width, width))


def test_a_part_reads_its_block_as_one_run_and_names_a_region_that_is_not_one() -> None:
    meta = TensorMeta("o", "float32", (32, 64), 0, 32 * 64 * 4, 32 * 64 * 4, 0, (1, 2))
    zero, one = plans(2)
    assert PartLayout(one).runs_of(meta) == ([4096], [8192])
    assert PartLayout(one).block_of(meta) == 1 and PartLayout(zero).block_of(meta) == 0
    assert block_index(((0, 16), (32, 32)), (32, 64), (1, 2)) is None  # straddles both blocks
    straddling = PartPlan(index=0, tensors={"o": [((0, 16), (32, 32))]})
    with pytest.raises(PartMismatchError, match="not one of those blocks"):
        PartLayout(straddling).runs_of(meta)


def test_a_table_entry_with_blocks_that_do_not_split_its_shape_is_refused() -> None:
    check_blocks((1, 2), (32, 64), name="o")
    for blocks in ((0, 2), (2, 2), (1, 3), (1, 1), (1,)):
        with pytest.raises(WireError, match="do not split"):
            check_tensor_meta(TensorMeta("o", "float32", (32, 64), 0, 8192, 8192, 0, blocks), bucket_nbytes=8192)
    plain = TensorMeta("o", "float32", (32, 64), 0, 8192, 8192, 0)
    assert len(encode_tensors([plain])) < len(encode_tensors([TensorMeta("o", "float32", (32, 64), 0, 8192, 8192,
                                                                          0, (1, 2))]))  # absent unless set


@pytest.mark.parametrize("group_bytes", [None, 512], ids=["groups", "small-groups"])
@pytest.mark.parametrize("bucket_bytes", [1 << 20, 20_000])
def test_the_planner_packs_blocked_tensors_block_after_block_and_the_parts_sums_agree(
        bucket_bytes: int, group_bytes: int | None, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Whole or split across buckets (20 KB buckets cut ``down``'s 32 KiB), the buckets hold each blocked tensor's
    blocks one after the other and the others in their own order; each part's sums folded from the packed buckets,
    and those the sender folds as it packs (``PartsDigest``: a blocked tensor's rows copied a group at a time, the
    same rows of every block, each block's span hashed into the sums of the part that holds it), equal its sums of
    the same tensors in their own order (what a receiver of the tensors' own order folds); a whole digest, which
    reads the bucket in order, reads the blocked piece once it is packed. With small groups every blocked piece is
    several groups."""
    if group_bytes is not None:
        monkeypatch.setattr(blocks, "GROUP_BYTES", group_bytes)
    block_packing.cache_clear()  # groups of the size set here (cleared again after)
    request.addfinalizer(block_packing.cache_clear)
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) for name, shape in SHAPES.items()}
    parts = plans(2)
    blocked = candidates([plan.tensors for plan in parts])
    payload = bytearray()
    metas: list[TensorMeta] = []
    packing = PartsDigest([PartSums(plan) for plan in parts], whole=False)
    for bucket in plan_buckets(list(tensors.items()), bucket_bytes=bucket_bytes, devices=frozenset({"cpu"}),
                               blocked=blocked):
        buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        digest = UpdateDigest()
        pack_hashing(buffer.data_ptr(), bucket, digest)
        packing.pieces([meta for meta, _, _ in bucket.items])
        packing.begin_bucket(b"", bucket.nbytes)
        again = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        pack_hashing(again.data_ptr(), bucket, packing)
        for meta, _, _ in bucket.items:
            metas.append(msgspec.structs.replace(meta, bucket_offset=len(payload) + meta.bucket_offset))
        payload += bytes(buffer.numpy())
        check = UpdateDigest()
        check.update_at(buffer.data_ptr(), bucket.nbytes)
        assert digest.hexdigest() == check.hexdigest()  # hashed in the bucket, in order
    whole = torch.frombuffer(payload, dtype=torch.uint8)
    for name, tensor in tensors.items():
        pieces = [meta for meta in metas if meta.name == name]
        data = torch.cat([whole[meta.bucket_offset:meta.bucket_offset + meta.nbytes] for meta in pieces])
        if name in blocked:
            assert all(meta.blocks == (DIMS[name], 2) for meta in pieces)
            assert data.equal(packed(tensor, DIMS[name], 2)), name
        else:
            assert all(not meta.blocks for meta in pieces) and data.equal(tensor.view(torch.uint8).reshape(-1))
    for plan, packed_sums in zip(parts, packing.parts):
        folded, own = PartSums(plan), PartSums(plan)
        folded.fold_all(metas, whole.data_ptr())
        for name, tensor in tensors.items():
            own.fold(TensorMeta(name, "float32", tuple(tensor.shape), 0, tensor.nbytes, tensor.nbytes),
                     tensor.data_ptr())
        assert folded.sums() == own.sums() and folded.nbytes == own.nbytes, plan.index
        assert packed_sums.sums() == own.sums() and packed_sums.nbytes == own.nbytes, plan.index
        assert folded.nbytes < 0.6 * sum(math.prod(shape) * 4 for shape in SHAPES.values())
