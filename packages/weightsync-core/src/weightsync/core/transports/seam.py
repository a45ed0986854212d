"""The seam: how one filled bucket gets from the sender to its receivers — what a transport gives the pipeline.

Everything else — planning, packing, double buffering, headers, digests, reassembly, timing — is the pipeline's
(:mod:`weightsync.core.pipeline.send`, :mod:`weightsync.core.pipeline.receive`), written once. A backend supplies a
:class:`Transport`: the engine builds one per worker with its settings, asks it for metadata (``prepare``), for the
topology (``build_topology``, on the driver) and, per membership epoch, for a :class:`SenderTransport` or a
:class:`ReceiverTransport`, which move opaque header bytes plus ``nbytes`` of payload from a slot of the sender's
ring to every receiver of the epoch, in order.

A transport declares where its buffers live (``buffers``: ``"host"`` or ``"device"``), and may supply a
:class:`DevicePolicy` that orders the pipeline's copies on device streams. Transports compose: a relay is a
``ReceiverTransport`` of one transport whose received payloads a ``SenderTransport`` of another publishes.

Threading: the pipeline calls ``SenderTransport.publish`` from one transfer thread, in bucket order, and
``wait_slot`` from its packing thread; ``ReceiverTransport.receive`` from one receive thread and ``release`` from
the consumer's thread (or from the receive thread, once the consumer has left; never two at once). Every blocking
call takes an absolute ``deadline`` (``time.monotonic()`` seconds) and raises ``TransferError`` naming the peer when
it passes; none spins a core while waiting.

Slots, tokens and the order of releases — the rules both sides keep (an engine built with ``check_transport=True``
checks every one of them, :mod:`weightsync.core.transports.rules`, and the conformance kit builds every bucket
engine so):

1. *Sender slots.* The pipeline writes into ``buffer(slot)`` only after ``wait_slot(slot)`` returned since the slot
   was last published, and publishes the buckets of an update in order, then a marker (``NO_SLOT``: the final
   header, or an abort). ``wait_slot`` returns only once every receiver released what the slot last carried.
2. *Tokens.* ``receive`` gives a marker token 0, and a bucket a positive token that no bucket still held carries
   (a sequence number, or a slot's number: a token may come again once released). Releasing 0 does nothing.
3. *Views until release.* A bucket's ``payload`` keeps its bytes until its token is released: the transport neither
   receives into that buffer again nor lets its sender reuse the slot before then.
4. *Releases in order.* The pipeline releases each bucket's token exactly once, in the order the buckets arrived —
   including buckets its consumer never read (a consumer that left, an update that failed) — so a transport may
   acknowledge by sequence (:class:`~weightsync.core.transports.waiting.AckedPeers` takes an acknowledgement out of
   order for a protocol error). ``release`` does not block beyond sending that acknowledgement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import torch

from weightsync.core.wire import codec

__all__ = ["Arrived", "BufferPlace", "NO_SLOT", "OrdersPackedSlots", "ReceivedBucket", "ReceiverTransport",
           "SenderTransport"]

BufferPlace = Literal["host", "device"]

NO_SLOT = codec.NO_SLOT
"""Slot of a message without payload (the final and abort markers)."""


class SenderTransport(Protocol):
    slots: int
    capacity: int
    """Bytes of each slot's buffer (the engine's ``bucket_bytes``)."""

    def buffer(self, slot: int) -> torch.Tensor:
        """The flat uint8 buffer of ``slot``, where the pipeline packs a bucket."""
        ...

    def wait_slot(self, slot: int, deadline: float) -> None:
        """Block until every receiver released what ``slot`` last carried (so it may be overwritten; rule 1)."""
        ...

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        """Hand the first ``nbytes`` of ``slot`` and ``header`` to every receiver; ``slot`` may be ``NO_SLOT``.

        Returns once the transport no longer reads the slot's buffer or once receivers will ask for it via
        ``wait_slot`` (a one-sided transport), whichever the backend implements.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class OrdersPackedSlots(Protocol):
    """An optional capability of a :class:`SenderTransport` with device buffers: it moves a slot on a stream of its
    own, ordered after an event the packing records (``mark_packed``), so packing returns without waiting for its
    copies. A device transport without it (one another process reads one-sidedly) is published only once the
    packing copies have completed."""

    def mark_packed(self, slot: int) -> None:
        """On the pack thread, inside the copy stream, after the last copy into ``slot``."""
        ...


@dataclass
class ReceivedBucket:
    header: bytes
    payload: torch.Tensor
    """Flat uint8 view of the bucket's bytes; valid until ``release(token)`` (rule 3)."""
    token: int
    """0 for a marker; else positive, and carried by no other bucket still held (rule 2)."""


class Arrived:
    """A received bucket, its header decoded, on its way to the consumer (``token`` as in ``ReceivedBucket``)."""

    __slots__ = ("header", "payload", "token", "table", "fused")

    def __init__(self, header: codec.BucketHeader, payload: torch.Tensor, token: int, table: bytes = b"",
                 fused: bool = False) -> None:
        self.header = header
        self.payload = payload
        self.token = token
        self.table = table
        self.fused = fused
        """The consumer hashes this bucket as it reads it (a host payload); else the receive thread hashed it."""


class ReceiverTransport(Protocol):
    capacity: int

    def receive(self, deadline: float) -> ReceivedBucket:
        """Block until the next message arrives; return its header bytes and payload view."""
        ...

    def release(self, token: int) -> None:
        """The consumer is done with a received bucket: its buffer may be reused. Called once per bucket, in the
        order the buckets arrived (rule 4)."""
        ...

    def close(self) -> None: ...
