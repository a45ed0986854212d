"""Where the view of a tensor that arrives in pieces is gathered: buffers of the engine's, kept from update to update.

A consumer of views (``async for``, vLLM's loader) takes each tensor whole, so a tensor whose ranges span buckets, or
come from several senders (a sharded ``actor_wg``'s streams), is copied into a buffer piece by piece, and the view of
it lives there until the consumer asks for its next view or batch (the views' lifetime, ``ReceivedWeights``). Three
things make that cheap where it used to cost more than the update's hashing (a 495 MB model whose larger matrices
span 16 MiB buckets: the copies took 121 ms of a receiver's 145):

* the buffers outlive the update, so their pages are faulted in once (fresh memory is written at about 0.5 GB/s):
  a buffer whose view the consumer is done with gathers the next tensor (:class:`Gathers`). One sender's pieces come
  in order, one tensor after the other, so one buffer serves them all, as large as the largest tensor gathered;
  several senders' come in any order, several tensors at once, and the engine keeps as many buffers as were ever
  in use at once (of the free ones, the ``KEPT_FREE`` largest);
* a worker that holds a part (``weightsync.core.wire.parts``) copies only its own byte runs of each piece — half of
  each split matrix at tensor parallelism 2 — as ``copy_into`` does;
* a large tensor's bytes are written with streaming stores (``copy_stream``), which do not read the buffer's lines
  first: 45 MB in 3.6 ms against 6.2 with ``Tensor.copy_`` here. The loader reads them back from memory anyway:
  a tensor this large does not stay in the cache beside the buckets.

Every byte of a buffer outside what the current tensor's pieces write reads as zero, never as an earlier tensor's
bytes: a loader that took more than its regions would otherwise take finite values that no sum covers. Each buffer
keeps the runs an earlier tensor left there (``_stale``) and zeroes, when a tensor begins, those the new tensor
does not write — nothing at all when each tensor is written whole.
"""

from __future__ import annotations

import array
import bisect

import torch

from weightsync.core.native import copy_batch
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.parts import PartLayout, Runs, clipped

__all__ = ["Gather", "Gathers"]

Spans = list[tuple[int, int]]
"""Sorted, disjoint byte ranges of the buffer: ``(start, end)``."""

STREAM_BYTES = 4 << 20
"""A tensor of at least this many bytes is gathered with streaming stores; a smaller one stays in the cache for its
loader."""

KEPT_SPANS = 16
"""Up to this many stale ranges, and ranges a tensor writes, the bytes to zero are found exactly; past them (a block
of columns sent in its own order: one run per row) the stale ranges' hull is zeroed, unless the new tensor writes
exactly the stale ranges (bytes already zero cost a ``memset``, never a wrong byte)."""

KEPT_FREE = 32
"""At most this many free buffers are kept, the largest (a sender far ahead of another can leave many tensors
begun at once: their buffers are not all kept for the engine's life)."""

HOLDS_SCAN = 4
"""Of the free buffers of one capacity, the last this many are looked at for one that needs no zeroing."""

PLACED = 1 << 14
"""At most this many pieces' copies are kept (cleared when full)."""


class Gather:
    """One buffer a tensor is gathered in, and which of its bytes hold an earlier tensor's."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._stale: Spans = []
        """The ranges that may hold an earlier tensor's bytes; every other byte of the buffer is zero."""

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def begin(self, meta: TensorMeta, written: Spans, device: torch.device) -> None:
        """``meta``'s tensor begins, its pieces to write ``written`` of it (:func:`_written`): the buffer takes its
        bytes, and the stale bytes it leaves are zeroed."""
        buffer = self._buffer
        total = meta.total_nbytes
        if buffer.numel() < total or buffer.device != device:
            buffer = self._buffer = torch.zeros(total, dtype=torch.uint8, device=device)
            self._stale = []
        if self.holds(written):  # (the same runs as the tensor before: a layer's after the layer before)
            return
        stale = self._stale
        if len(stale) > KEPT_SPANS or len(written) > KEPT_SPANS:  # their hull, zeroed inside the tensor
            low, high = (stale[0][0], stale[-1][1]) if stale else (0, 0)
            if low < min(high, total):
                buffer[low:min(high, total)].zero_()
            self._stale = written + [(max(low, total), high)] if high > total else written
            return
        inside = [(start, min(end, total)) for start, end in stale if start < total]
        for start, end in _outside(inside, written):
            buffer[start:end].zero_()
        self._stale = written + [(max(start, total), end) for start, end in stale if end > total]

    def holds(self, written: Spans) -> bool:
        """Whether the stale bytes are exactly ``written``'s (a tensor that writes them leaves nothing to zero)."""
        return self._stale == written

    def write(self, meta: TensorMeta, piece: torch.Tensor, copies: array.array[int] | None) -> None:
        """Copy ``meta``'s ``piece`` in: whole, or ``copy_batch``'s ``copies`` of it (a part's runs)."""
        if piece.device.type != "cpu":
            self._buffer[meta.offset: meta.offset + meta.nbytes].copy_(piece)
            return
        copy_batch(copies if copies is not None else [meta.offset, 0, meta.nbytes], self._buffer.data_ptr(),
                   piece.data_ptr(), stream=meta.total_nbytes >= STREAM_BYTES)

    def view(self, nbytes: int) -> torch.Tensor:
        return self._buffer[:nbytes]


class Gathers:
    """The engine's gather buffers (module docstring): the tensors being gathered, each in a buffer of its own, the
    buffers whose views the consumer holds, and the free ones."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Gather, int]] = {}
        """Per tensor begun and not complete: its buffer and the bytes written so far."""
        self._lent: list[Gather] = []
        """Buffers whose views were handed out since the consumer last asked for more (:meth:`recycle`)."""
        self._free: dict[int, list[Gather]] = {}
        """The free buffers by capacity (a model of many small tensors keeps many: found by size, not by a scan)."""
        self._sizes: list[int] = []
        """The capacities ``_free`` holds buffers of, sorted."""
        self._count = 0
        """How many buffers ``_free`` holds."""
        self._placed: dict[tuple[str, int, int, tuple[int, ...]], tuple[Runs, array.array[int]]] = {}
        """Per piece of a part-holder's tensor: its runs and the copies that place them (a model's next update repeats
        its pieces), bounded by ``PLACED``."""

    def start(self) -> None:
        """An update begins: every buffer is free (a tensor an earlier update failed in the middle of included)."""
        self.recycle()
        for gather, _ in self._open.values():
            self._release(gather)
        self._open.clear()

    def recycle(self) -> None:
        """The consumer asks for its next view or batch (or is done with a fallback's view): the views handed out
        before are no longer valid, and their buffers are free."""
        for gather in self._lent:
            self._release(gather)
        self._lent.clear()

    def put(self, meta: TensorMeta, piece: torch.Tensor, layout: PartLayout | None) -> torch.Tensor | None:
        """Gather ``meta``'s ``piece`` (of this worker's part only, where ``layout`` is one and the piece is in host
        memory); the tensor's bytes (a view of its buffer, valid until :meth:`recycle`) once every byte its stream
        carries is in, else None."""
        runs = layout.runs_of(meta) if layout is not None and piece.device.type == "cpu" else None
        gather, arrived = self._open.pop(meta.name, (None, 0))
        if gather is None:
            spans = _written(meta, runs)
            gather = self._take(meta.total_nbytes, spans)
            gather.begin(meta, spans, piece.device)
        gather.write(meta, piece, self._copies(meta, runs) if runs is not None else None)
        arrived += meta.nbytes
        if arrived < meta.carried:
            self._open[meta.name] = gather, arrived
            return None
        self._lent.append(gather)
        return gather.view(meta.total_nbytes)

    def _take(self, nbytes: int, spans: Spans) -> Gather:
        """The free buffer of the least capacity that fits ``nbytes`` (of those, one whose stale bytes are exactly
        ``spans``, if one of the last few is: nothing to zero), else the largest (it grows), else a new one."""
        at = bisect.bisect_left(self._sizes, nbytes)
        if not self._sizes:
            return Gather()
        size = self._sizes[min(at, len(self._sizes) - 1)]
        pool = self._free[size]
        chosen = next((gather for gather in reversed(pool[-HOLDS_SCAN:]) if gather.holds(spans)), pool[-1])
        pool.remove(chosen)
        self._count -= 1
        if not pool:
            del self._free[size]
            self._sizes.remove(size)
        return chosen

    def _release(self, gather: Gather) -> None:
        """``gather`` is free: kept, unless ``KEPT_FREE`` larger ones are (the smallest kept then goes)."""
        capacity = gather.capacity
        if self._count >= KEPT_FREE:
            if capacity <= self._sizes[0]:
                return
            self._take(self._sizes[0], [])
        if capacity not in self._free:
            self._free[capacity] = []
            bisect.insort(self._sizes, capacity)
        self._free[capacity].append(gather)
        self._count += 1

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


def _written(meta: TensorMeta, runs: Runs | None) -> Spans:
    """The ranges of ``meta``'s tensor its pieces write: a part's ``runs`` of it, else what its stream carries."""
    if runs is not None:
        return list(zip(*runs))
    return [(meta.span[0], meta.span[1])] if meta.span else [(0, meta.total_nbytes)]


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
