"""Where the view of a tensor split across buckets is gathered: one buffer per engine, kept from update to update.

A consumer of views (``async for``, vLLM's loader) takes each tensor whole, so a tensor whose ranges span buckets is
copied into this buffer piece by piece, and the view of it lives there until the next split tensor. Three things
make that cheap where it used to cost more than the update's hashing (a 495 MB model whose larger matrices span
16 MiB buckets: the copies took 121 ms of a receiver's 145):

* the buffer outlives the update, so its pages are faulted in once (fresh memory is written at about 0.5 GB/s); it
  holds as many bytes as the largest tensor gathered so far, for as long as the engine lives;
* a worker that holds a part (``weightsync.core.wire.parts``) copies only its own byte runs of each piece — half of
  each split matrix at tensor parallelism 2 — as ``copy_into`` does;
* a large tensor's bytes are written with streaming stores (``copy_stream``), which do not read the buffer's lines
  first: 45 MB in 3.6 ms against 6.2 with ``Tensor.copy_`` here. The loader reads them back from memory anyway:
  a tensor this large does not stay in the cache beside the buckets.

Every byte of the buffer outside what the current tensor's pieces write reads as zero, never as an earlier tensor's
bytes: a loader that took more than its regions would otherwise take finite values that no sum covers. The buffer
keeps the runs an earlier tensor left there (``_stale``) and zeroes, at a tensor's first piece, those the new tensor
does not write — nothing at all when each tensor is written whole.
"""

from __future__ import annotations

import array

import torch

from weightsync.core.native import copy_batch
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.parts import PartLayout, Runs, clipped

__all__ = ["Gather"]

Spans = list[tuple[int, int]]
"""Sorted, disjoint byte ranges of the buffer: ``(start, end)``."""

STREAM_BYTES = 4 << 20
"""A tensor of at least this many bytes is gathered with streaming stores; a smaller one stays in the cache for its
loader."""

KEPT_SPANS = 16
"""At most this many stale ranges are kept exactly; a tensor written in more (a block of columns sent in its own
order: one run per row) leaves their hull, zeroed whole next time (bytes inside it that are already zero cost a
``memset``, never a wrong byte)."""

PLACED = 1 << 14
"""At most this many pieces' copies are kept (cleared when full)."""


class Gather:
    """The buffer split tensors are gathered in, and which of its bytes hold an earlier tensor's."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._stale: Spans = []
        """The ranges that may hold an earlier tensor's bytes; every other byte of the buffer is zero."""
        self._placed: dict[tuple[str, int, int, tuple[int, ...]], tuple[Runs, array.array[int]]] = {}
        """Per piece of a part-holder's tensor: its runs and the copies that place them (a model's next update repeats
        its pieces), bounded by ``PLACED``."""

    def put(self, meta: TensorMeta, piece: torch.Tensor, layout: PartLayout | None) -> torch.Tensor | None:
        """Gather ``meta``'s ``piece`` (of this worker's part only, where ``layout`` is one and the piece is in host
        memory); the tensor's bytes (a view of the buffer, valid until the next split tensor) once its last piece is
        in, else None. The pieces of one tensor come in order (the first at the start of what its stream carries),
        one tensor after the other."""
        runs = layout.runs_of(meta) if layout is not None and piece.device.type == "cpu" else None
        buffer = self._buffer
        if buffer is None or buffer.numel() < meta.total_nbytes or buffer.device != piece.device:
            buffer = self._buffer = torch.zeros(meta.total_nbytes, dtype=torch.uint8, device=piece.device)
            self._stale = []
        if meta.offset == (meta.span[0] if meta.span else 0):  # the tensor's first piece
            written = (list(zip(*runs)) if runs is not None else
                       [(meta.span[0], meta.span[1])] if meta.span else [(0, meta.total_nbytes)])
            self._begin(buffer, written, meta.total_nbytes)
        if piece.device.type != "cpu":
            buffer[meta.offset: meta.offset + meta.nbytes].copy_(piece)
        else:
            copies = [meta.offset, 0, meta.nbytes] if runs is None else self._copies(meta, runs)
            copy_batch(copies, buffer.data_ptr(), piece.data_ptr(), stream=meta.total_nbytes >= STREAM_BYTES)
        return buffer[: meta.total_nbytes] if meta.completes else None

    def _copies(self, meta: TensorMeta, runs: Runs) -> array.array[int]:
        """``copy_batch``'s triples that copy the runs in ``meta``'s piece to where they lie in the tensor's bytes."""
        key = (meta.name, meta.offset, meta.nbytes, meta.blocks)
        known = self._placed.get(key)
        if known is not None and known[0] is runs:  # (runs of another part are another object: found anew)
            return known[1]
        if len(self._placed) >= PLACED:
            self._placed.clear()
        first = meta.offset
        copies = array.array("Q", [value for low, high in clipped(runs, first, first + meta.nbytes)
                                   for value in (low, low - first, high - low)])
        self._placed[key] = runs, copies
        return copies

    def _begin(self, buffer: torch.Tensor, written: Spans, total: int) -> None:
        """A tensor of ``total`` bytes whose pieces will write ``written`` begins: zero the stale bytes it leaves."""
        inside = [(start, min(end, total)) for start, end in self._stale if start < total]
        beyond = [(max(start, total), end) for start, end in self._stale if end > total]
        for start, end in _outside(inside, written) if len(written) <= KEPT_SPANS else inside:
            buffer[start:end].zero_()
        kept = written if len(written) <= KEPT_SPANS else [(written[0][0], written[-1][1])]
        self._stale = kept + beyond


def _outside(spans: Spans, cut: Spans) -> Spans:
    """The parts of ``spans`` outside every range of ``cut`` (both sorted and disjoint)."""
    left: Spans = []
    at = 0
    for start, end in spans:
        while at < len(cut) and cut[at][1] <= start:
            at += 1
        scan = at
        while start < end:
            if scan == len(cut) or cut[scan][0] >= end:
                left.append((start, end))
                break
            if cut[scan][0] > start:
                left.append((start, cut[scan][0]))
            start = max(start, cut[scan][1])
            scan += 1
    return left
