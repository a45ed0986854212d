"""A receiver's side of delta updates from a sharded ``actor_wg`` (:mod:`weightsync.api.sources`): every sender
keeps the base of its own shards and encodes its own stream against it, so a receiver keeps what it holds per sender.

One :class:`~weightsync.core.delta.receiver.ReceiverDelta` per sender (its kept buckets, its version and model digest,
its verification), each bucket handed to its sender's by the header's ``sender``; the host copies of the tensors a
``copy_into`` consumer's fallback takes are shared (a tensor's ranges come from several senders). The update's final
header, merged by the receiver of every stream, carries each sender's end (``BucketHeader.ends``): each sender's
version is checked and held on its own. An update is delta from every sender or from none: a sender that sends its
stream full while the others send changes is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

from weightsync.api.errors import TransferError
from weightsync.core.delta.copies import PlacedCopies
from weightsync.core.delta.receiver import ReceiverDelta
from weightsync.core.transports.seam import Arrived, ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.destinations import Fallback
from weightsync.core.wire.parts import PartLayout

__all__ = ["SourcesDelta"]


class SourcesDelta:
    """``ReceiverDelta``'s interface over the streams of several senders (module docstring)."""

    def __init__(self, *, verify_every: int) -> None:
        self.verify_every = verify_every
        self.placed = PlacedCopies()
        self._each: dict[int, ReceiverDelta] = {}
        self._bases: dict[int, int] = {}
        """This update's base per sender, from its stream's first bucket."""
        self._layout: PartLayout | None = None

    def _of(self, sender: int) -> ReceiverDelta:
        delta = self._each.get(sender)
        if delta is None:  # new: it holds nothing, as a begun one does
            delta = self._each[sender] = ReceiverDelta(verify_every=self.verify_every, placed=self.placed)
            delta.layout = self._layout
        return delta

    @property
    def wrote(self) -> bool:
        return any(delta.wrote for delta in self._each.values())

    def begin(self, part: PartLayout | None = None) -> None:
        """A new update starts; ``part``: this worker's, by which a tensor packed block after block is handed over
        (each sender's copies hold the whole of what it sends)."""
        self.placed.begin()
        self._bases, self._layout = {}, part
        for delta in self._each.values():
            delta.begin(part, alone=False)

    def check_base(self, header: codec.BucketHeader, peer: str) -> None:
        """A stream's first bucket: refused when its base is not the other streams' (changes from some senders, the
        whole stream from others), or not what this receiver holds from its sender."""
        other = next(((sender, base) for sender, base in self._bases.items() if base != header.base), None)
        if other is not None:
            raise TransferError(f"actor rank {header.sender} sent its stream against base {header.base} and actor rank "
                                f"{other[0]} against {other[1]}: an update is delta from every sender or none",
                                peer=peer)
        self._bases[header.sender] = header.base
        self._of(header.sender).check_base(header, peer)

    def take(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None,
             fallback: Fallback | None = None, *, transport: ReceiverTransport | None = None,
             shards: Mapping[str, torch.Tensor] | None = None) -> bool:
        return self._of(arrived.header.sender).take(arrived, destinations, fallback, transport=transport,
                                                    shards=shards)

    def read(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None, *,
             shards: Mapping[str, torch.Tensor] | None = None) -> None:
        self._of(arrived.header.sender).read(arrived, destinations, shards=shards)

    def complete(self, header: codec.BucketHeader, *, receiver: int, peer: str) -> None:
        """The merged final header: each sender's version checked and held (its end in ``header.ends``)."""
        for end in header.ends:
            self._of(end.sender).complete(msgspec.structs.replace(header, index=end.index, base=end.base,
                                                                  model=end.model),
                                          receiver=receiver, peer=f"{peer} (actor rank {end.sender})")
        if header.model:
            self.placed.complete()
