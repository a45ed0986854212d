"""Versions kept on the host for delta updates, bucket by bucket in the bucket's own layout (padding zero): the
sender's base, and a receiver's copy for a consumer that iterates views; and, tensor by tensor, a receiver's copies of
the tensors a ``copy_into`` consumer's fallback takes (:class:`PlacedCopies`)."""

from __future__ import annotations

import array
import mmap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.api.errors import TransferError
from weightsync.core.delta.encoding import held_sum
from weightsync.core.wire import codec
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.tensors import DTYPES

__all__ = ["BaseCopies", "BucketCopy", "PlacedCopies"]


@dataclass(slots=True)
class BucketCopy:
    """One bucket of a kept version: its table and its bytes in the bucket's layout (padding zero)."""

    table: bytes
    data: torch.Tensor
    total: int | None = None
    """Its keyed sum, when known (a sender keeps it up to date across deltas)."""
    part_totals: dict[tuple[bytes, int], int] = field(default_factory=dict)
    """Each part's keyed sum of its held ranges, by the part's key, when known (``weightsync.core.delta.parts``; a
    sender keeps them up to date across deltas)."""
    segments: tuple[tuple[tuple[bytes, int], ...], array.array[int]] | None = None
    """The encoder's segments of its pieces for some parts (by their keys), kept for the next update."""

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def sum(self, index: int, metas: Sequence[TensorMeta]) -> int:
        """Its keyed sum (it is bucket ``index``, whose pieces are ``metas``), computed and remembered."""
        self.total = held_sum(index, [(meta, self.data, meta.bucket_offset) for meta in metas])
        return self.total


@dataclass
class BaseCopies:
    """A version kept on the host, bucket by bucket: the sender's base, or a receiver's copy for a consumer that
    iterates views (it gets whole tensors from a delta only through this copy). ``version`` is None while the copy
    is being changed or after an update that did not complete: it then holds no version anyone can rely on."""

    version: int | None = None
    model: str = ""
    """The model digest of ``version``."""
    buckets: list[BucketCopy] = field(default_factory=list)
    partial: bool = False
    """Whether the copy holds a part alone (``weightsync.core.delta.parts``): its buckets then take memory only
    where the part's ranges were written, and it cannot be served again whole."""

    def match(self, index: int, table: bytes, nbytes: int) -> BucketCopy | None:
        """The kept bucket ``index`` when it has this table and size (so its pieces line up), else None."""
        if index < len(self.buckets):
            kept = self.buckets[index]
            if kept.table == table and kept.nbytes == nbytes:
                return kept
        return None

    def replace(self, index: int, table: bytes, nbytes: int) -> BucketCopy:
        """A copy for bucket ``index`` to be rewritten whole: the kept one when it lines up, else a fresh zeroed one
        (the layout changed, or the copy is new). Its sum is unknown until it is computed again."""
        kept = self.match(index, table, nbytes)
        if kept is not None:
            kept.total = None
            kept.part_totals.clear()
        else:
            kept = BucketCopy(table, _untouched(nbytes) if self.partial else torch.zeros(nbytes, dtype=torch.uint8))
            if index < len(self.buckets):
                self.buckets[index] = kept
            else:
                self.buckets.append(kept)
        return kept

    def hold(self, partial: bool) -> None:
        """Whether the copy is to hold a part alone from now on: a change drops what it holds (the next update must
        be full, which the receiver's base check sees: it holds no version then)."""
        if partial != self.partial:
            self.partial, self.buckets, self.version = partial, [], None

    def truncate(self, count: int) -> None:
        """Drop the buckets past ``count`` (the model got smaller)."""
        del self.buckets[count:]

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self.buckets)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The kept version as ``(name, tensor)`` pairs in the order its buckets carried them (what a peer serves a
        joining replica: sent again in the same buckets, it has the same model digest): a tensor in one piece is a
        view of its bucket, one split across buckets is put together."""
        if self.partial:
            raise TransferError("this worker keeps its part of the model alone, which cannot be served again",
                                peer="this worker")
        pieces: dict[str, torch.Tensor] = {}
        for kept in self.buckets:
            for meta in codec.decode_table(kept.table):
                if meta.blocks or meta.span:
                    how = "in block order" if meta.blocks else "in part (its host took in only its workers' regions)"
                    raise TransferError(f"{meta.name!r} is kept {how}, which cannot be served again",
                                        peer="this worker")
                piece = kept.data[meta.bucket_offset:meta.bucket_offset + meta.nbytes]
                if meta.offset == 0 and meta.nbytes == meta.total_nbytes:
                    yield meta.name, piece.view(DTYPES[meta.dtype]).reshape(meta.shape)
                    continue
                whole = pieces.setdefault(meta.name, torch.empty(meta.total_nbytes, dtype=torch.uint8))
                whole[meta.offset:meta.offset + meta.nbytes].copy_(piece)
                if meta.offset + meta.nbytes == meta.total_nbytes:
                    yield meta.name, pieces.pop(meta.name).view(DTYPES[meta.dtype]).reshape(meta.shape)


class PlacedCopies:
    """A receiver's host copies (bytes) of the tensors a ``copy_into`` consumer's fallback takes: as of this update
    (during one) or the held version, what changes to them apply to. A tensor is handed to the fallback once every
    byte of it was written this update: its ranges may come from several senders' streams, in any order (a sharded
    ``actor_wg``, whose senders' delta receivers share one ``PlacedCopies``)."""

    def __init__(self) -> None:
        self.copies: dict[str, torch.Tensor] = {}
        self._base: dict[str, torch.Tensor] = {}
        self._written: dict[str, int] = {}

    def begin(self) -> None:
        """A new update: the copies become its base (each taken over as its first piece arrives)."""
        self._base, self.copies, self._written = self.copies, {}, {}

    def complete(self) -> None:
        """The update completed: copies of tensors it did not write (the fallback no longer takes them) go."""
        self._base = {}

    def get(self, meta: TensorMeta, *, fresh: bool, untouched: bool = False) -> torch.Tensor:
        """The copy a piece of ``meta``'s tensor is written to: this update's, the base's (to apply changes to), or,
        for a piece sent dense (``fresh``), a new one (``untouched``: that takes memory only where written, for a
        worker that writes its part alone)."""
        copy = self.copies.get(meta.name)
        if copy is None:
            copy = self._base.pop(meta.name, None)
            if copy is None or copy.numel() != meta.total_nbytes:
                if not fresh:
                    raise TransferError(f"changes to {meta.name!r} arrived, but this receiver kept no copy of it to "
                                        "apply them to (its fallback took it): it needs a full update",
                                        peer="this receiver")
                copy = _untouched(meta.total_nbytes) if untouched else torch.empty(meta.total_nbytes, dtype=torch.uint8)
            self.copies[meta.name] = copy
        return copy

    def written(self, meta: TensorMeta) -> bool:
        """``meta``'s piece was written (count each once): whether every byte of its tensor now was."""
        done = self._written.get(meta.name, 0) + meta.nbytes
        self._written[meta.name] = done
        return done >= meta.carried


def _untouched(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed host memory that takes none until written: a private anonymous mapping of its own (an
    allocator's block may reuse pages other data dirtied, ``torch.zeros`` writes every page, and a shared mapping
    would take a page for every page read)."""
    if not nbytes:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
