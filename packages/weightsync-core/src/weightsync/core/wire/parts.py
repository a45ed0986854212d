"""A worker's part on the wire: its regions as byte runs of each tensor, and the sums that verify it.

A part (``weightsync.api.parts.Part``) keeps, of each checkpoint tensor, nothing, the whole, or boxes. Of a tensor's
contiguous row-major bytes, the boxes select sorted, disjoint **byte runs** (:func:`byte_runs`: a block of rows is one
run, a block of columns one run per row, or one where the tensor travels block after block:
:mod:`weightsync.core.wire.blocks`). A part's **sums** (:class:`PartSums`) are, for every tensor the part keeps anything
of, in stream order, an XXH3-64 of its name, dtype and shape and then of its selected bytes in row-major order: eight
bytes per tensor. They do not depend on how tensors were cut into buckets or pieces (a piece is a consecutive range of a
tensor's bytes; the runs inside it come in order), so the sender folds them as it packs and a receiver as it reads, each
touching only the part's bytes, and a receiver whose sums differ can name the first tensor that differs.

The sender folds every distinct part of its receivers' (``RankPlan.parts``) and puts their sums on the update's
final header (``BucketHeader.parts``); a receiver folds its own (``RankPlan.part``) and compares.
"""

from __future__ import annotations

import array
import bisect
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import msgspec
import torch
import xxhash

from weightsync.api.errors import ConfigError, PartMismatchError
from weightsync.api.parts import Region
from weightsync.core.native import copy_batch
from weightsync.core.wire.blocks import block_index, block_runs
from weightsync.core.wire.codec import BucketHeader, TensorMeta
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.partplans import Box, PartPlan
from weightsync.core.wire.tensors import DTYPES, memoryview_at

__all__ = ["Copy", "PartLayout", "PartSums", "PartsDigest", "byte_runs", "check_box", "check_sums", "clipped"]

SUM_BYTES = 8

Runs = tuple[list[int], list[int]]
"""Sorted, disjoint byte runs of one tensor: their starts and their ends."""


def check_box(box: Box, shape: Sequence[int], *, name: str) -> None:
    """A ``ConfigError`` naming tensor ``name`` where ``box`` is malformed or does not fit its ``shape``."""
    start, size = box
    try:
        region = Region(start=tuple(start), size=tuple(size))
    except ConfigError as exc:
        raise ConfigError(f"part: a region of {name!r}: {exc}") from None
    if not region.fits(shape):
        raise ConfigError(f"part: the region start={tuple(start)} size={tuple(size)} of {name!r} does not fit its "
                          f"shape {tuple(shape)}")


def byte_runs(boxes: Sequence[Box], shape: Sequence[int], itemsize: int, *, name: str) -> Runs:
    """The byte runs ``boxes`` select of a tensor of ``shape`` (row-major, ``itemsize`` bytes per element), merged;
    a ``ConfigError`` naming the tensor when a box does not fit it."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    starts: list[torch.Tensor] = []
    ends: list[torch.Tensor] = []
    for start, size in boxes:
        check_box((start, size), shape, name=name)
        if 0 in size:
            continue
        if not shape:  # a scalar: its one element
            starts.append(torch.zeros(1, dtype=torch.int64))
            ends.append(torch.full((1,), itemsize, dtype=torch.int64))
            continue
        last = len(shape) - 1  # trailing dimensions the box spans whole merge into one run
        while last > 0 and start[last] == 0 and size[last] == shape[last]:
            last -= 1
        offsets = torch.zeros(1, dtype=torch.int64)
        for d in range(last):
            steps = torch.arange(start[d], start[d] + size[d], dtype=torch.int64) * strides[d]
            offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
        first = (offsets + start[last] * strides[last]) * itemsize
        starts.append(first)
        ends.append(first + size[last] * strides[last] * itemsize)
    if not starts:
        return [], []
    begin, end = torch.cat(starts), torch.cat(ends)
    order = torch.argsort(begin)
    begin, end = begin[order], end[order]
    reach = torch.cummax(end, 0).values
    opens = torch.ones(len(begin), dtype=torch.bool)
    opens[1:] = begin[1:] > reach[:-1]  # a run that starts past every earlier end opens a merged run
    closing = torch.nonzero(opens).flatten()
    last_of = torch.cat([closing[1:] - 1, torch.tensor([len(begin) - 1])])
    return begin[opens].tolist(), reach[last_of].tolist()


DIRECT_BYTES = 16 << 10
"""A run at least this long is hashed where it lies; shorter ones (the rows of a block of columns) are gathered."""
GATHER_BYTES = 256 << 10
"""Short runs are gathered into a buffer in cache, one native copy per this many bytes, and hashed in one call."""
FOLD_BYTES = 512 * 1024
"""The sender folds its parts' sums from this many consecutive bytes (two 256 KiB copies) at a time, right behind
the copies in the core's cache (:class:`PartsDigest`; 1 MiB packed the bench's model 5 % slower, 4 MiB 13 %)."""

Step = tuple[int, int] | tuple["array.array[int]", int]
"""How to read a piece's selected bytes: ``(offset, nbytes)`` where they lie, or ``(copy_batch triples, nbytes)``."""


class Copy(NamedTuple):
    """A group of a piece's copies out of its part (:meth:`PartLayout.copies`)."""

    triples: array.array[int]
    """``copy_batch``'s (destination offset, piece offset, nbytes) triples."""
    start: int
    """Where the group's bytes begin in a shard (contiguous there)."""
    nbytes: int


class PartLayout:
    """What a part's sums need of a model's tensors, kept across updates (a model's next update repeats its
    layout): each tensor's byte runs, each piece's steps, and the buffer short runs are gathered into."""

    def __init__(self, plan: PartPlan, known: PartLayout | None = None) -> None:
        """``known``: a layout of the same regions (an earlier epoch's), whose runs and steps this one takes over."""
        self.plan = plan
        self._runs: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], Runs | None]] = {}
        """Per tensor: the dtype, shape and blocks its runs are for, and the runs (None: the whole tensor)."""
        self._steps: dict[tuple[str, str, tuple[int, ...], int, int, tuple[int, ...]], tuple[list[Step], int]] = {}
        self._copies: dict[tuple[str, str, tuple[int, ...], int, int, tuple[int, ...], bool], list[Copy]] = {}
        self._scratch: torch.Tensor | None = None
        if known is not None:
            self._runs, self._steps, self._copies, self._scratch = known._runs, known._steps, known._copies, \
                known._scratch

    def runs_of(self, meta: TensorMeta) -> Runs | None:
        known = self._runs.get(meta.name)
        if known is not None and known[0] == meta.dtype and known[1] == meta.shape and known[2] == meta.blocks:
            return known[3]
        boxes = self.plan.tensors.get(meta.name)
        if boxes and meta.blocks:  # packed block after block: the part's block is one run
            runs: Runs | None = block_runs(self.block_of(meta), meta.name, meta.total_nbytes, meta.blocks)
        else:
            runs = None if boxes is None else byte_runs(boxes, meta.shape, DTYPES[meta.dtype].itemsize, name=meta.name)
        self._runs[meta.name] = (meta.dtype, meta.shape, meta.blocks, runs)
        return runs

    def block_of(self, meta: TensorMeta) -> int | None:
        """Which block of a tensor sent block by block (``meta.blocks``) this part holds; None when it holds none of
        it, or the tensor came in its own order."""
        boxes = self.plan.tensors.get(meta.name)
        return block_index(boxes[0], meta.shape, meta.blocks) if meta.blocks and boxes and len(boxes) == 1 else None

    def steps(self, meta: TensorMeta, runs: Runs) -> tuple[list[Step], int]:
        """How to read ``meta``'s piece of a tensor whose runs are ``runs``, and how many bytes that is."""
        key = (meta.name, meta.dtype, meta.shape, meta.offset, meta.nbytes, meta.blocks)
        known = self._steps.get(key)
        if known is None:
            known = self._steps[key] = _steps(runs, meta.offset, meta.offset + meta.nbytes)
        return known

    def shard_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of a tensor's shard (the size of its one box); None where the part has not one box of it."""
        boxes = self.plan.tensors.get(name)
        return tuple(boxes[0][1]) if boxes is not None and len(boxes) == 1 else None

    def copies(self, meta: TensorMeta, runs: Runs, *, compact: bool) -> list[Copy]:
        """How to copy ``meta``'s piece of the part out, in groups of about ``GATHER_BYTES`` (each copied and then
        hashed while it is in cache). Destination offsets are the tensor's own (a full-shape destination), or with
        ``compact`` the places in a shard that holds the one box's elements in row-major order (the selected bytes
        before this piece come first), where each group's bytes are contiguous."""
        key = (meta.name, meta.dtype, meta.shape, meta.offset, meta.nbytes, meta.blocks, compact)
        known = self._copies.get(key)
        if known is None:
            known = self._copies[key] = _copies(runs, meta.offset, meta.offset + meta.nbytes, compact)
        return known

    def scratch(self) -> int:
        if self._scratch is None:
            self._scratch = torch.zeros(GATHER_BYTES, dtype=torch.uint8)  # faulted in once
        return int(self._scratch.data_ptr())


def _copies(runs: Runs, first: int, end: int, compact: bool) -> list[Copy]:
    starts, ends = runs
    at = bisect.bisect_right(ends, first)
    # Where the piece's first selected byte goes in a shard: past the runs before it and the head of one it cuts.
    place = sum(ends[:at]) - sum(starts[:at]) + max(0, first - starts[at]) if at < len(starts) else 0
    groups: list[Copy] = []
    triples: list[int] = []
    begin = grouped = 0
    for low, high in clipped(runs, first, end):
        for cut in range(low, high, GATHER_BYTES):  # a long run in pieces of GATHER_BYTES
            nbytes = min(GATHER_BYTES, high - cut)
            if not triples:
                begin = place
            triples += (place if compact else cut, cut - first, nbytes)
            place, grouped = place + nbytes, grouped + nbytes
            if grouped >= GATHER_BYTES:
                groups.append(Copy(array.array("Q", triples), begin, grouped))
                triples, grouped = [], 0
    if triples:
        groups.append(Copy(array.array("Q", triples), begin, grouped))
    return groups


def _steps(runs: Runs, first: int, end: int) -> tuple[list[Step], int]:
    steps: list[Step] = []
    group: list[int] = []
    gathered = total = 0
    for low, high in clipped(runs, first, end):
        if high - low >= DIRECT_BYTES or gathered + high - low > GATHER_BYTES:
            if group:
                steps.append((array.array("Q", group), gathered))
                group, gathered = [], 0
        if high - low >= DIRECT_BYTES:
            steps.append((low - first, high - low))
        else:
            group += (gathered, low - first, high - low)
            gathered += high - low
        total += high - low
    if group:
        steps.append((array.array("Q", group), gathered))
    return steps, total


def clipped(runs: Runs, first: int, end: int) -> Iterator[tuple[int, int]]:
    """The runs' parts inside the tensor's bytes ``[first, end)`` (a piece's), in order."""
    starts, ends = runs
    for at in range(bisect.bisect_right(ends, first), len(starts)):
        if starts[at] >= end:
            return
        yield max(starts[at], first), min(ends[at], end)


class PartSums:
    """The sums of one part (module docstring) for one update, folded piece by piece in stream order."""

    def __init__(self, layout: PartLayout | PartPlan) -> None:
        self.layout = layout if isinstance(layout, PartLayout) else PartLayout(layout)
        self.plan = self.layout.plan
        self.names: list[str] = []
        """The tensors folded so far, in order (the sums' order)."""
        self._sums = bytearray()
        self._hash: xxhash.xxh3_64 | None = None
        self._open = ""
        """The tensor ``_hash`` folds."""
        self.nbytes = 0
        """Bytes of the part read and hashed so far."""

    def route(self, header: BucketHeader) -> None:
        """The next bucket is ``header``'s: sums of several senders' streams or stripes fold it into its own
        (``weightsync.core.wire.sources.SourcesSums``, ``StripesSums``); these sums fold them all."""

    def fold(self, meta: TensorMeta, address: int) -> None:
        """Fold one piece: ``meta``'s range of its tensor's bytes, which lie in host memory at ``address``."""
        runs = self.layout.runs_of(meta)
        if runs is not None and not runs[0]:
            return  # nothing of this tensor
        hashing = self.open(meta)
        if runs is None:
            if meta.nbytes:
                hashing.update(memoryview_at(address, meta.nbytes))
                self.nbytes += meta.nbytes
        else:
            steps, total = self.layout.steps(meta, runs)
            for where, nbytes in steps:
                if isinstance(where, int):
                    hashing.update(memoryview_at(address + where, nbytes))
                else:
                    scratch = self.layout.scratch()
                    copy_batch(where, scratch, address)
                    hashing.update(memoryview_at(scratch, nbytes))
            self.nbytes += total
        self.close(meta)

    def open(self, meta: TensorMeta) -> xxhash.xxh3_64:
        """Begin folding a piece of ``meta``'s tensor that the part holds some of, whose selected bytes the caller
        feeds to the hash it returns in order (and counts in ``nbytes``); then :meth:`close`."""
        if self._hash is not None and (meta.offset == 0 or meta.name != self._open):
            self._end()  # a sender's range of a tensor that ends before the tensor does (a shard)
        if self._hash is None:
            self._hash, self._open = xxhash.xxh3_64(), meta.name
            self._hash.update(f"{meta.name}\0{meta.dtype}\0{tuple(meta.shape)}".encode())
        return self._hash

    def close(self, meta: TensorMeta) -> None:
        """End folding a piece (the tensor's sum, at its last piece; a shard's, when the next tensor begins)."""
        if meta.completes:
            self._end()

    def _end(self) -> None:
        if self._hash is not None:
            self.names.append(self._open)
            self._sums += self._hash.intdigest().to_bytes(SUM_BYTES, "little")
            self._hash = None

    def fold_all(self, metas: Sequence[TensorMeta], base: int) -> None:
        """Fold every piece of a bucket whose payload lies at ``base``."""
        for meta in metas:
            self.fold(meta, base + meta.bucket_offset)

    def sums(self) -> bytes:
        self._end()
        return bytes(self._sums)

    def tensor_names(self) -> list[str]:
        """The tensors whose sums :meth:`sums` holds, in its order."""
        return self.names


def check_sums(sums: PartSums, expected: Sequence[bytes], *, receiver: int, peer: str) -> None:
    """A receiver's part against the sums ``peer`` sent for it: a ``PartMismatchError`` naming this receiver and the
    first tensor whose regions differ."""
    index = sums.plan.index
    if not 0 <= index < len(expected):
        raise PartMismatchError(f"rollout rank {receiver} holds part {index}, but {peer} sent the sums of "
                                f"{len(expected)} parts: the update was not planned for this receiver's part",
                                receiver=receiver, tensor="", expected="", actual="")
    mine, theirs = sums.sums(), expected[index]
    if mine == theirs:
        return
    if len(mine) != len(theirs):  # a tensor of the part missing (or cut short), or one too many
        raise PartMismatchError(
            f"rollout rank {receiver} received {len(mine) // SUM_BYTES} tensors of its part where {peer} sent "
            f"{len(theirs) // SUM_BYTES}", receiver=receiver, tensor="", expected=theirs.hex()[:32],
            actual=mine.hex()[:32])
    at = next(at for at in range(len(mine) // SUM_BYTES)
              if mine[at * SUM_BYTES:(at + 1) * SUM_BYTES] != theirs[at * SUM_BYTES:(at + 1) * SUM_BYTES])
    tensor = sums.tensor_names()[at]
    raise PartMismatchError(
        f"rollout rank {receiver} received other bytes than {peer} sent of its part of {tensor!r}: the update was "
        f"corrupted in transit, or this worker does not hold the part it was planned for",
        receiver=receiver, tensor=tensor, expected=theirs.hex()[:32], actual=mine.hex()[:32])


class PartsDigest(UpdateDigest):
    """A sender's digest that also folds every distinct part's sums from the bytes it is fed, so each piece is
    hashed for the parts right behind its copy, while in cache (``pack_hashing`` feeds a bucket's payload in order,
    from the bucket or from a large piece's source, which hold the same bytes; a piece packed block after block, a
    group of rows of every block at a time: :meth:`begin_blocks`).

    With ``whole`` False (every receiver of the update verifies a part, none the whole digest) the whole digest is
    not computed at all, and the update's digest is a digest of the parts' sums (:meth:`hexdigest`), which every
    receiver reports as the final header carries it."""

    def __init__(self, parts: Sequence[PartSums], *, whole: bool) -> None:
        super().__init__()
        self.parts = list(parts)
        self.whole = whole
        self._metas: Sequence[TensorMeta] = ()
        self._next = 0
        """The first piece of the current bucket not folded whole yet."""
        self._at = self._nbytes = 0
        """Bytes of the current bucket's payload fed so far, and in all."""
        self._pending = (0, 0, 0)
        """Bytes fed and not folded yet: where they lie, and their range of the payload."""
        self._blocks: list[tuple[PartSums, int, xxhash.xxh3_64]] = []
        """While a piece is fed block by block: each part, the block it holds, its sum's hash."""
        self._fed: list[int] = []
        """Bytes of each block fed so far."""

    def pieces(self, metas: Sequence[TensorMeta]) -> None:
        """The current bucket's pieces (in bucket order), before its payload is fed."""
        self._metas, self._next, self._at, self._pending = metas, 0, 0, (0, 0, 0)

    def begin_bucket(self, table: bytes, nbytes: int) -> None:
        self._nbytes = nbytes
        if self.whole:
            super().begin_bucket(table, nbytes)

    def update_at(self, address: int, nbytes: int) -> None:
        if self.whole:
            super().update_at(address, nbytes)
        # Consecutive bytes (a large piece's source, 256 KiB a call) are folded once FOLD_BYTES of them are fed.
        start, low, high = self._pending
        if address != start + high - low:  # not right after what is pending: that first
            self._fold(start, low, high)
            start, low = address, high
        high += nbytes
        self._at += nbytes
        if high - low >= FOLD_BYTES or self._at >= self._nbytes:  # enough, or the bucket's last bytes
            self._fold(start, low, high)
            start, low = start + high - low, high
        self._pending = (start, low, high)

    def begin_blocks(self, meta: TensorMeta) -> bool:
        """With no whole digest to fold and every part holding one block of ``meta``'s tensor: fold what was fed
        before it, and open each part's sum of the tensor for its block's bytes."""
        blocks = [block for sums in self.parts if (block := sums.layout.block_of(meta)) is not None]
        if self.whole or len(blocks) < len(self.parts):
            return False
        start, low, high = self._pending
        self._fold(start, low, high)
        self._blocks = [(sums, block, sums.open(meta)) for sums, block in zip(self.parts, blocks)]
        self._fed = [0] * meta.blocks[1]
        return True

    def update_block(self, block: int, address: int, nbytes: int) -> None:
        view = memoryview_at(address, nbytes)
        for _, held, hashing in self._blocks:
            if held == block:
                hashing.update(view)
        self._fed[block] += nbytes

    def end_blocks(self, meta: TensorMeta, address: int) -> None:
        for sums, block, _ in self._blocks:
            sums.nbytes += self._fed[block]
            sums.close(meta)
        self._blocks = []
        self._next += 1  # the piece, which the bucket's next bytes follow
        self._at += meta.nbytes
        self._pending = (address + meta.nbytes, self._at, self._at)

    def _fold(self, address: int, low: int, high: int) -> None:
        """Fold the current bucket's payload bytes ``[low, high)``, which lie at ``address``."""
        metas = self._metas
        while self._next < len(metas):
            meta = metas[self._next]
            start, end = meta.bucket_offset, meta.bucket_offset + meta.nbytes
            if start > high or (start == high and meta.nbytes):
                return  # not fed yet
            if end > low or not meta.nbytes:
                first, last = max(start, low), min(end, high)
                piece = meta if (first, last) == (start, end) else msgspec.structs.replace(
                    meta, offset=meta.offset + first - start, nbytes=last - first, bucket_offset=first)
                for sums in self.parts:
                    sums.fold(piece, address + first - low)
            if end > high:
                return  # the rest of it comes next
            self._next += 1

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        if self.whole:
            super().update_bucket(table, payload)
        for sums in self.parts:
            sums.fold_all(self._metas, payload.data_ptr())

    def hexdigest(self) -> str:
        if self.whole:
            return super().hexdigest()
        folded = xxhash.xxh3_128()
        for sums in self.parts:
            folded.update(sums.sums())
        return f"parts-{folded.hexdigest()}"
