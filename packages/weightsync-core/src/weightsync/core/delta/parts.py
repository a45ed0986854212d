"""Delta updates into workers that keep their part alone (``weightsync.api.parts``).

A worker that iterates views keeps a host copy of the version it holds, to apply the next update's changes to
(:class:`~weightsync.core.delta.copies.BaseCopies`). A worker that declared its part keeps only what its part holds
of each piece: the copy's other pages are never written, so they take no memory (a tensor-parallel worker of N keeps
about 1/N of the model, not the whole of it), and reading them gives zeros, which the worker's loader does not read.
Its views keep the checkpoint's shapes.

What a part holds of a piece, in delta updates, is a few **held ranges** (:meth:`PartWords.ranges`): its byte runs
inside the piece, rounded out to the piece's 8-byte words (the keyed sums' terms are words); the whole piece where
the part holds more than :data:`MAX_RANGES` runs of it (a block of columns is a run per row); none where it holds
nothing. The sender and every worker compute them alike from the plan.

Verification follows the part: the sender folds, besides the model digest, each distinct part's **part model
digest** (the same fold over every bucket, of the keyed sums of the part's held ranges alone) and sends them on the
update's final header (``BucketHeader.part_models``, in the order of the senders' plan); a worker applies and sums
its held ranges alone and compares its part's. The sender sums each part's ranges of a kept bucket once, when the
bucket is written whole; from then on the compiled encoder adds each changed word's term change to the sums of the
parts that hold the word (:func:`part_segments`), as it does to the bucket's own sum.
"""

from __future__ import annotations

import array
import bisect
from collections.abc import Sequence

import torch

from weightsync.core.delta.encoding import held_sum
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.parts import PartLayout

__all__ = ["MAX_PARTS", "MAX_RANGES", "PartWords", "part_segments"]

MAX_RANGES = 8
"""A part that holds more runs of a piece than this holds the whole piece (in delta updates)."""

MAX_PARTS = 64
"""The most distinct parts whose sums the compiled encoder keeps up to date as it compares (a bit each); past them,
each part's sums are taken from the sender's kept copy every update."""

Ranges = tuple[tuple[int, int], ...]
"""Held ranges of a piece: ``(start, end)`` from its first byte, sorted, disjoint."""


class PartWords:
    """What a worker of one part holds of each piece in delta updates (module docstring), kept across updates."""

    def __init__(self, layout: PartLayout) -> None:
        self.layout = layout
        self.key = (layout.plan.key(), layout.plan.index)
        """What tells this part from another: its regions and its place in the senders' plan."""
        self._ranges: dict[tuple[str, str, tuple[int, ...], int, int, tuple[int, ...]], Ranges] = {}

    @classmethod
    def of(cls, layout: PartLayout, known: dict[tuple[bytes, int], PartWords]) -> PartWords:
        """``layout``'s, from ``known`` (kept across updates and epochs, by the part's regions and index) when
        there."""
        words = cls(layout)
        return known.setdefault(words.key, words)

    @property
    def index(self) -> int:
        """The part's place in the senders' plan (its part model digest's, on the final header)."""
        return self.layout.plan.index

    def ranges(self, meta: TensorMeta) -> Ranges:
        """The held ranges of ``meta``'s piece."""
        key = (meta.name, meta.dtype, meta.shape, meta.offset, meta.nbytes, meta.blocks)
        known = self._ranges.get(key)
        if known is None:
            known = self._ranges[key] = self._find(meta)
        return known

    def _find(self, meta: TensorMeta) -> Ranges:
        runs = self.layout.runs_of(meta)
        if runs is None:
            return ((0, meta.nbytes),) if meta.nbytes else ()
        starts, ends = runs
        first, end = meta.offset, meta.offset + meta.nbytes
        low, high = bisect.bisect_right(ends, first), bisect.bisect_left(starts, end)
        if low >= high:
            return ()
        if high - low > MAX_RANGES:
            return ((0, meta.nbytes),)
        held: list[tuple[int, int]] = []
        for at in range(low, high):
            start = (max(starts[at], first) - first) // 8 * 8
            stop = min(-(-(min(ends[at], end) - first) // 8) * 8, meta.nbytes)
            if held and start <= held[-1][1]:  # rounded out to words, two runs may meet
                held[-1] = (held[-1][0], max(held[-1][1], stop))
            else:
                held.append((start, stop))
        return tuple(held)

    def segments(self, metas: Sequence[TensorMeta]) -> array.array[int]:
        """``delta_apply``'s ``held`` for a bucket's pieces: per piece, a count and ``(end, held)`` pairs that
        cover it."""
        out = array.array("Q")
        for meta in metas:
            pairs: list[int] = []
            at = 0
            for start, stop in self.ranges(meta):
                if start > at:
                    pairs += (start, 0)
                pairs += (stop, 1)
                at = stop
            if at < meta.nbytes or not pairs:
                pairs += (meta.nbytes, 0)
            out.append(len(pairs) // 2)
            out.extend(pairs)
        return out

    def copies(self, metas: Sequence[TensorMeta]) -> list[int]:
        """``copy_batch`` triples that copy a bucket's held ranges to the same places of another bucket."""
        return [value for meta in metas for start, stop in self.ranges(meta)
                for value in (meta.bucket_offset + start, meta.bucket_offset + start, stop - start)]

    def bucket_sum(self, index: int, metas: Sequence[TensorMeta], data: torch.Tensor) -> int:
        """The keyed sum of the held ranges of bucket ``index`` (pieces ``metas``), whose bytes lie in ``data`` in
        the bucket's layout."""
        return held_sum(index, [(meta, data, meta.bucket_offset) for meta in metas], self.ranges)


def part_segments(parts: Sequence[PartWords], metas: Sequence[TensorMeta]) -> array.array[int]:
    """The encoder's ``segments`` for a bucket's pieces (``weightsync.core.native.delta_encode``): per piece, a count
    and ``(end, mask)`` pairs that cover it, bit ``b`` of a mask set where ``parts[b]`` holds the bytes (at most
    :data:`MAX_PARTS` parts)."""
    out = array.array("Q")
    for meta in metas:
        held = [part.ranges(meta) for part in parts]
        ends = sorted({meta.nbytes, *(edge for ranges in held for start, stop in ranges for edge in (start, stop))})
        pairs: list[int] = []
        for end in ends:
            if end == 0:
                continue
            mask = sum(1 << bit for bit, ranges in enumerate(held)
                       if any(start < end <= stop for start, stop in ranges))
            if pairs and pairs[-1] == mask:  # the same parts as the segment before: one segment
                pairs[-2] = end
            else:
                pairs += (end, mask)
        out.append(len(pairs) // 2)
        out.extend(pairs)
    return out
