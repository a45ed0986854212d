"""The small interface a backend implements: how one filled bucket gets from the sender to its receivers.

Everything else — planning, packing, double buffering, headers, digests, reassembly, timing — is the pipeline's
(:mod:`weightsync.core.engine`), written once. A transport moves opaque header bytes plus ``nbytes`` of payload
from a slot of the sender's ring to every receiver of the epoch, in order.

Threading: the pipeline calls ``SenderTransport.publish`` from one transfer thread, in bucket order, and
``wait_slot`` from its packing thread; ``ReceiverTransport.receive`` from one receive thread and ``release`` from
the consumer's thread. Every blocking call takes an absolute ``deadline`` (``time.monotonic()`` seconds) and raises
``TransferError`` naming the peer when it passes; none spins a core while waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["SenderTransport", "ReceiverTransport", "ReceivedBucket", "TransportHook", "NO_SLOT"]

NO_SLOT = -1
"""Slot of a message without payload (the final and abort markers)."""


class SenderTransport(Protocol):
    slots: int
    capacity: int
    """Bytes of each slot's buffer (the engine's ``bucket_bytes``)."""

    def buffer(self, slot: int) -> torch.Tensor:
        """The flat uint8 buffer of ``slot``, where the pipeline packs a bucket."""
        ...

    def wait_slot(self, slot: int, deadline: float) -> None:
        """Block until every receiver is done with what ``slot`` last carried (so it may be overwritten)."""
        ...

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        """Hand the first ``nbytes`` of ``slot`` and ``header`` to every receiver; ``slot`` may be ``NO_SLOT``.

        Returns once the transport no longer reads the slot's buffer or once receivers will ask for it via
        ``wait_slot`` (a one-sided transport), whichever the backend implements.
        """
        ...

    def close(self) -> None: ...


@dataclass
class ReceivedBucket:
    header: bytes
    payload: torch.Tensor
    """Flat uint8 view of the bucket's bytes; valid until ``release(token)``."""
    token: int


class ReceiverTransport(Protocol):
    capacity: int

    def receive(self, deadline: float) -> ReceivedBucket:
        """Block until the next message arrives; return its header bytes and payload view."""
        ...

    def release(self, token: int) -> None:
        """The consumer is done with a received bucket: its buffer may be reused."""
        ...

    def close(self) -> None: ...


class TransportHook(Protocol):
    """Test hook (engine option ``transport_hook="module:attribute"``) to corrupt buckets deliberately.

    ``after_pack`` runs on the sender after a bucket is packed and before it is hashed (a fault the digest cannot
    see: only a byte-level comparison catches it). ``after_receive`` runs on a receiver after the bucket arrived
    and before it is hashed (corruption in transit: the digest catches it). Either may mutate ``payload``.
    """

    def after_pack(self, index: int, payload: torch.Tensor) -> None: ...

    def after_receive(self, index: int, payload: torch.Tensor) -> None: ...
