"""Several senders' streams read as one update: a sharded ``actor_wg`` (:mod:`weightsync.api.sources`).

On the wire a shard is nothing new: a block of rows of a tensor is one contiguous range of the full tensor's row-major
bytes, so it travels as the pieces of a split tensor do (``TensorMeta`` ranges of the full tensor, ``offset`` where the
shard's bytes begin), and a receiver that reads every sender's stream completes each tensor from the ranges the
senders hold (:func:`shard_range` here on the sender).

What verifies such an update is per sender: each sender's stream is hashed as any sender's is (its digest, its
parts' sums), and a receiver folds every bucket into the digest and the sums of the sender it came from
(:class:`SourcesDigest`, :class:`SourcesSums`, routed by the bucket header's ``sender``). The update's digest combines
the senders' in the order of the topology's ``senders`` (:func:`combine_sources`), what the manager compares; a part's
sums are the senders' sums one after another, in that order. A striped update's parts are verified the same way, a
stripe for a sender (:class:`StripesSums`, routed by the bucket's index).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from weightsync.api.errors import WeightStreamError, WireError
from weightsync.api.sources import Shard, byte_range
from weightsync.core.wire.codec import BucketHeader, TensorMeta
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.parts import PartLayout, PartSums

__all__ = ["SourcesDigest", "SourcesSums", "StripesSums", "as_shard", "combine_sources", "shard_range"]


def as_shard(name: str, value: object) -> Shard | None:
    """``value`` as a :class:`Shard` when it is one, or a torch ``DTensor`` (its local shard and where that lies in
    the full tensor, read without a collective); None for anything else."""
    if isinstance(value, Shard):
        return value
    if not isinstance(value, torch.Tensor) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return None
    from torch.distributed.tensor import DTensor  # only a stream that yields tensor subclasses pays the import

    if not isinstance(value, DTensor):
        return None
    chunks = value.__create_chunk_list__()  # type: ignore[no-untyped-call]
    if len(chunks) != 1:
        raise WeightStreamError(f"{name!r} is a DTensor of {len(chunks)} local chunks on this rank; a sharded source "
                                "sends one box of each tensor")
    return Shard(tensor=value.to_local(), shape=tuple(value.shape), start=tuple(chunks[0].offsets))


def shard_range(name: str, shard: Shard) -> tuple[int, int]:
    """The bytes ``[first, end)`` of the full tensor that ``shard`` holds; a ``WeightStreamError`` naming the tensor
    when they are not one contiguous range (a block of columns: not built) or the shard does not fit."""
    tensor = shard.tensor
    if not isinstance(tensor, torch.Tensor):
        raise WeightStreamError(f"the shard of {name!r} holds a {type(tensor).__name__}, not a tensor")
    try:
        where = byte_range(shard.shape, shard.region, tensor.element_size())
    except Exception as exc:  # noqa: BLE001 - a malformed box, said with the tensor's name
        raise WeightStreamError(f"the shard of {name!r}: {exc}") from None
    if where is None:
        raise WeightStreamError(
            f"the shard of {name!r} (start {tuple(shard.start)}, size {tuple(tensor.shape)} of {tuple(shard.shape)}) "
            "is not one contiguous range of the tensor's rows: a sharded source sends blocks of rows (Shard(0)) or "
            "whole tensors")
    return where


def combine_sources(digests: Sequence[str]) -> str:
    """The digest of an update sent by several senders, each its own stream, from each sender's digest in the order
    of the topology's ``senders`` (one sender: its own)."""
    if len(digests) == 1:
        return digests[0]
    combined = xxhash.xxh3_128()
    combined.update(f"weightsync sources {len(digests)}".encode())
    for digest in digests:
        combined.update(digest.encode() + b"\0")
    return str(combined.hexdigest())


class SourcesDigest(UpdateDigest):
    """A receiver's digest of an update from several senders: each bucket folded into its sender's digest
    (:meth:`select`, by the bucket header's ``sender``, before the bucket is begun)."""

    def __init__(self, senders: Sequence[int], make: Any = UpdateDigest) -> None:
        super().__init__()
        self._senders = list(senders)
        self._digests: dict[int, UpdateDigest] = {sender: make() for sender in self._senders}
        self._current: UpdateDigest = self._digests[self._senders[0]]

    def of(self, sender: int) -> UpdateDigest:
        current = self._digests.get(sender)
        if current is None:
            raise WireError(f"a bucket names actor rank {sender} as its sender, which is not one of {self._senders}")
        return current

    def select(self, sender: int) -> None:
        self._current = self.of(sender)

    def begin_bucket(self, table: bytes, nbytes: int) -> None:
        self._current.begin_bucket(table, nbytes)

    def update_at(self, address: int, nbytes: int) -> None:
        self._current.update_at(address, nbytes)

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self._current.update_bucket(table, payload)

    def hexdigest(self) -> str:
        return combine_sources([self._digests[sender].hexdigest() for sender in self._senders])


class SourcesSums(PartSums):
    """A receiver's part sums of an update from several senders: one :class:`PartSums` per sender, the pieces of each
    bucket folded into its sender's (:meth:`route`, by the bucket header's ``sender``); :meth:`sums` and ``names`` are
    theirs one after another, in the senders' order, as the final header's sums are combined."""

    def __init__(self, layout: PartLayout, senders: Sequence[int]) -> None:
        super().__init__(layout)
        self._senders = list(senders)
        self._each = {sender: PartSums(layout) for sender in self._senders}
        self._current = self._each[self._senders[0]]

    def route(self, header: BucketHeader) -> None:
        self._current = self._each[header.sender]

    def fold(self, meta: TensorMeta, address: int) -> None:
        before = self._current.nbytes
        self._current.fold(meta, address)
        self.nbytes += self._current.nbytes - before

    def open(self, meta: TensorMeta) -> xxhash.xxh3_64:
        return self._current.open(meta)

    def close(self, meta: TensorMeta) -> None:
        self._current.close(meta)

    def sums(self) -> bytes:
        return b"".join(self._each[sender].sums() for sender in self._senders)

    def tensor_names(self) -> list[str]:
        return [name for sender in self._senders for name in self._each[sender].tensor_names()]


class StripesSums(SourcesSums):
    """A receiver's part sums of an update dealt into ``stripes`` stripes (``weightsync.core.transports.chain.stripes``):
    stripe s's sender folds its part sums over its own buckets (i with i mod K = s), so the receiver folds each bucket
    into its stripe's, and the final header carries each part's sums stripe after stripe."""

    def __init__(self, layout: PartLayout, stripes: int) -> None:
        super().__init__(layout, range(stripes))

    def route(self, header: BucketHeader) -> None:
        self._current = self._each[header.index % len(self._senders)]
