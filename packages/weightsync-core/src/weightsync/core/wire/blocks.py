"""Blocks: a tensor every receiver holds one block of, along a dimension past the first, travels block after block.

Tensor parallelism splits a row-parallel matrix (``o_proj``, ``down_proj``) along its columns: each worker holds a
block of columns, which in the tensor's row-major bytes is one short run per row. Reading every other few KiB of each
row out of memory costs nearly what reading the rows does, so a worker that hashes or copies only its half of such a
tensor saves little. Where every distinct part of an update holds exactly one of ``count`` equal blocks of a tensor
along one dimension ``dim >= 1`` (:func:`candidates`, at setup, into the senders' plan: ``RankPlan.blocked``), the
sender packs that tensor's bytes **block after block**: the bytes of ``tensor.narrow(dim, i * width, width)`` in
row-major order, for i = 0 … count − 1. Its table entry says so (``TensorMeta.blocks = (dim, count)``), so a receiver
reads the layout from the wire, never from a guess. Each worker's block then lies contiguous:

- its part's sums read one run (:func:`block_runs`), and a shard is one copy;
- a full-shape destination takes the block's rows where they belong (:func:`block_copies`);
- a consumer of views (vLLM's loaders) gets a full-shape view (:func:`block_view`) whose elements inside the worker's
  block are its block's and whose others are other bytes of the same tensor — exactly what a loader that narrows its
  block out of the tensor reads, without a copy.

The part sums stay what :mod:`weightsync.core.wire.parts` defines (a block's bytes in row-major order are the same
bytes either way). Unstaged updates whose every receiver declared a part, with the sender's buckets on the host, go
block after block, full and delta ones alike (a delta compares each bucket with the one of the update before, in the
same layout; the sender decides: ``pipeline.send``); a block's row of a tensor of dtype size ``itemsize`` is
``width * prod(shape[dim + 1:]) * itemsize`` bytes.
"""

from __future__ import annotations

import array
import functools
import math
from collections.abc import Mapping, Sequence

import msgspec
import torch

from weightsync.api.errors import PartMismatchError, WireError

__all__ = ["BlockPlan", "Blocks", "PackGroup", "block_copies", "block_index", "block_packing", "block_runs",
           "block_view", "blocks_of", "candidates", "check_blocks"]

Blocks = tuple[int, ...]
"""``(dim, count)``: a tensor packed as ``count`` equal blocks along ``dim`` (``TensorMeta.blocks``, as it comes)."""

GROUP_BYTES = 256 << 10
"""Rows are copied in groups of about this many bytes, each hashed right behind its copy (``PIECE_BYTES``)."""


class BlockPlan(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A tensor whose every part is one block (a sender's ``RankPlan.blocked``): the dimension, the number of
    blocks, and the size of each block's box (the tensor's shape but for ``dim``, where it is the block's width)."""

    dim: int
    count: int
    size: tuple[int, ...]


def candidates(parts: Sequence[Mapping[str, Sequence[tuple[Sequence[int], Sequence[int]]]]]) -> dict[str, BlockPlan]:
    """The tensors that can travel block after block, from every distinct part's boxes (name → ``(start, size)``
    boxes; a name absent is held whole): those every part holds exactly one box of, the boxes equal but along one
    dimension ``>= 1``, where they are ``count >= 2`` equal, disjoint widths from 0 on, and start at 0 elsewhere."""
    if len(parts) < 2:
        return {}
    found: dict[str, BlockPlan] = {}
    for name in parts[0]:
        boxes = [part.get(name) for part in parts]
        if any(box is None or len(box) != 1 for box in boxes):
            continue
        starts = [tuple(box[0][0]) for box in boxes if box is not None]
        sizes = {tuple(box[0][1]) for box in boxes if box is not None}
        if len(sizes) != 1:
            continue
        size = sizes.pop()
        moved = {d for start in starts for d, at in enumerate(start) if at}
        if len(moved) != 1 or 0 in moved:
            continue
        dim = moved.pop()
        width = size[dim]
        if width and sorted(start[dim] for start in starts) == [i * width for i in range(len(starts))]:
            found[name] = BlockPlan(dim=dim, count=len(starts), size=size)
    return found


def blocks_of(plan: BlockPlan | None, shape: Sequence[int]) -> Blocks | None:
    """``(dim, count)`` when a tensor of ``shape`` is the one ``plan`` was made for (its blocks cover it exactly),
    else None (the tensor travels in its own order)."""
    if plan is None or len(shape) != len(plan.size) or not 1 <= plan.dim < len(shape):
        return None
    if any(extent != (plan.size[d] * plan.count if d == plan.dim else plan.size[d]) for d, extent in enumerate(shape)):
        return None
    return plan.dim, plan.count


def check_blocks(blocks: Sequence[int], shape: Sequence[int], *, name: str) -> None:
    """A received table entry's ``blocks`` against its shape: a ``WireError`` unless it is empty or a dimension past
    the first that ``count >= 2`` divides."""
    if not blocks:
        return
    if len(blocks) != 2 or not 1 <= blocks[0] < len(shape) or blocks[1] < 2 or shape[blocks[0]] % blocks[1]:
        raise WireError(f"tensor {name!r}: blocks {tuple(blocks)} do not split its shape {tuple(shape)}")


def _rows(shape: Sequence[int], dim: int, count: int, itemsize: int) -> tuple[int, int]:
    """(rows per block, bytes per row of a block)."""
    return math.prod(shape[:dim]), shape[dim] // count * math.prod(shape[dim + 1:]) * itemsize


def block_index(box: tuple[Sequence[int], Sequence[int]], shape: Sequence[int], blocks: Blocks) -> int | None:
    """Which block ``box`` is of a tensor of ``shape`` packed as ``blocks``; None when it is not exactly one."""
    dim, count = blocks
    start, size = box
    width = shape[dim] // count
    if len(start) != len(shape) or size[dim] != width or start[dim] % width:
        return None
    if any(start[d] or size[d] != shape[d] for d in range(len(shape)) if d != dim):
        return None
    return start[dim] // width


def block_runs(index: int | None, name: str, total: int, blocks: Blocks) -> tuple[list[int], list[int]]:
    """The byte run block ``index`` is of tensor ``name`` (``total`` bytes) packed as ``blocks``; a
    ``PartMismatchError`` where the part holds something else of it (``index`` None)."""
    if index is None:
        raise PartMismatchError(f"{name!r} was sent block by block ({blocks[1]} blocks along dimension {blocks[0]}), "
                                f"and this part's regions of it are not one of those blocks: the update was not "
                                f"planned for it", receiver=-1, tensor=name, expected="", actual="")
    count = blocks[1]
    return [index * total // count], [(index + 1) * total // count]


@functools.lru_cache(maxsize=4096)
def block_copies(shape: tuple[int, ...], itemsize: int, blocks: Blocks, first: int, end: int
                 ) -> tuple[tuple[array.array[int], int, int], ...]:
    """The rows of the packed bytes ``[first, end)`` of a tensor of ``shape``, for a receiver copying them into a
    full-shape destination: ``copy_batch`` triples (the tensor's own offset, packed offset − first, bytes) in groups of
    about ``GROUP_BYTES``, each ``(triples, start, nbytes)``, ``start`` the group's first byte relative to ``first``."""
    dim, count = blocks
    rows, row = _rows(shape, dim, count, itemsize)
    if end <= first or not row:
        return ()
    index = torch.arange(first // row, (end - 1) // row + 1, dtype=torch.int64)  # rows in packed order
    low, high, own = _clip(index, rows, row, count, first, end)
    triples = torch.stack([own, low - first, high - low], dim=1)
    per = max(1, GROUP_BYTES // row)
    return tuple((array.array("Q", triples[at:at + per].reshape(-1).tolist()), int(low[at]) - first,
                  int((high[at:at + per] - low[at:at + per]).sum())) for at in range(0, len(index), per))


PackGroup = tuple["array.array[int]", tuple[tuple[int, int, int], ...]]
"""A sender's group of rows (:func:`block_packing`): ``copy_batch`` triples, and the spans they fill."""


@functools.lru_cache(maxsize=4096)
def block_packing(shape: tuple[int, ...], itemsize: int, blocks: Blocks, first: int, end: int
                  ) -> tuple[PackGroup, ...]:
    """The rows of the packed bytes ``[first, end)`` of a tensor of ``shape``, for a sender packing them from the
    tensor: ``copy_batch`` triples (packed offset − first, the tensor's own offset, bytes) in groups that each take
    the same rows of every block, about ``GROUP_BYTES`` in all, so that the tensor is read front to back, row after
    row (reading one block's rows and then the next block's reads the tensor ``count`` times over, a run of each
    row at a time, which costs half as much again). Each group comes with its **spans**: for each block it fills,
    ``(block, start, nbytes)``, where its bytes lie contiguous, ``start`` relative to ``first``."""
    dim, count = blocks
    rows, row = _rows(shape, dim, count, itemsize)
    if end <= first or not row:
        return ()
    index = torch.arange(first // row, (end - 1) // row + 1, dtype=torch.int64)  # rows in packed order
    index = index[torch.argsort((index % rows) * count + index // rows)]  # the tensor's own order
    low, high, own = _clip(index, rows, row, count, first, end)
    triples = torch.stack([low - first, own, high - low], dim=1)
    group = (index % rows - int(index[0] % rows)) // max(1, GROUP_BYTES // (row * count))
    groups: list[PackGroup] = []
    at = 0
    for size in torch.unique_consecutive(group, return_counts=True)[1].tolist():
        spans: dict[int, tuple[int, int]] = {}
        for block, start, stop in zip((index[at:at + size] // rows).tolist(), low[at:at + size].tolist(),
                                      high[at:at + size].tolist()):
            began, filled = spans.get(block, (start, 0))
            spans[block] = (began, filled + stop - start)
        groups.append((array.array("Q", triples[at:at + size].reshape(-1).tolist()),
                       tuple((block, began - first, filled) for block, (began, filled) in spans.items())))
        at += size
    return tuple(groups)


def _clip(index: torch.Tensor, rows: int, row: int, count: int, first: int, end: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For packed rows ``index``: their bytes' range inside ``[first, end)`` (low, high) and where ``low`` lies in
    the tensor's own bytes."""
    low = torch.clamp(index * row, min=first)
    high = torch.clamp((index + 1) * row, max=end)
    return low, high, (index % rows) * count * row + (index // rows) * row + (low - index * row)


def block_view(data: torch.Tensor, shape: Sequence[int], blocks: Blocks, index: int) -> torch.Tensor:
    """A full-shape view of a tensor packed as ``blocks`` (``data``: its elements, flat, in packed order) whose
    block ``index`` holds that block's elements: ``view.narrow(dim, index * width, width)`` is the block, contiguous.
    Its other elements are other bytes of the same tensor (the view never reaches outside ``data``)."""
    dim, count = blocks
    width = shape[dim] // count
    box = [*shape[:dim], width, *shape[dim + 1:]]
    strides = [math.prod(box[d + 1:]) for d in range(len(box))]
    offset = index * (data.numel() // count) - index * width * strides[dim]
    return data.as_strided(tuple(shape), tuple(strides), data.storage_offset() + offset)
