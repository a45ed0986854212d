"""A ring of buckets registered with a one-sided transfer library, and an upstream's ring opened for reads.

The library-specific part of the chain (:mod:`weightsync.core.transports.chain.transport`): nixl and mooncake each
implement :class:`RegisteredRing` and :class:`RemoteRing`; :class:`RingEndpoint` is what a downstream learns of an upstream.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import msgspec
import torch

from weightsync.api.config import MiB
from weightsync.api.errors import WireError
from weightsync.core.transports.sharedmem import SharedSegment, new_segment_prefix, sweep_orphan_segments
from weightsync.core.wire import codec

__all__ = [
    "HOST_SHARED", "BucketReady", "PendingRead", "RingEndpoint", "RemoteRing", "RegisteredRing", "decode_ready",
    "decode_ring",
]

HOST_SHARED = "cpu-shared"
"""``device`` of a ring in host memory that every process of its host may map (a shared segment, named in the
ring's endpoint): the chain's two-level layout reads a host leader's ring in place."""


class RingEndpoint(msgspec.Struct, frozen=True, tag="ring"):
    """What a downstream needs to read from an upstream's ring, sent by the upstream after a valid ``Hello``."""

    wire: int
    epoch: str
    library: str
    """``"nixl"`` or ``"mooncake"``: both ends must use the same library."""
    agent: str
    """The library's name for the upstream: a NIXL agent name, a Mooncake session id (``host:port``)."""
    blob: bytes
    """Opaque data the library itself parses (NIXL agent metadata); empty for Mooncake. Never unpickled by us."""
    base: int
    """Address of slot 0 in the upstream's process (device memory address for a GPU ring)."""
    slot_bytes: int
    slots: int
    memory: str = "cpu"
    """Device of the ring: ``"cpu"`` or ``"cuda:N"``."""
    segment: str = ""
    """The shared segment holding a ``HOST_SHARED`` ring (empty otherwise): workers of the same host map it."""


_ring_decoder = msgspec.msgpack.Decoder(RingEndpoint)


class BucketReady(msgspec.Struct, frozen=True, tag="ready"):
    """An upstream announces bucket ``seq`` (1-based, counted per epoch) in its ``slot``; ``slot`` = NO_SLOT for the
    payload-less final and abort markers (``seq`` 0). ``header`` is the pipeline's encoded ``BucketHeader``.

    A relay announces a bucket while it is still arriving: first with ``available`` < ``nbytes`` (the bytes of the
    slot readable so far, no header) as each piece lands, then once whole (``available`` = -1, with the header), so
    the next hop reads each piece as soon as it is there and a hop adds a piece's time, not a bucket's."""

    wire: int
    epoch: str
    seq: int
    slot: int
    nbytes: int
    header: bytes
    available: int = -1

    @property
    def readable(self) -> int:
        """Bytes of the bucket the upstream's slot holds now."""
        return self.nbytes if self.available < 0 else min(self.available, self.nbytes)

    @property
    def complete(self) -> bool:
        return self.available < 0


_ready_decoder = msgspec.msgpack.Decoder(BucketReady)


def decode_ready(data: bytes, *, epoch: str, peer: str) -> BucketReady:
    return codec.decode_message(_ready_decoder, data, what="bucket announcement", epoch=epoch, peer=peer)


def decode_ring(data: bytes, *, epoch: str, library: str, peer: str) -> RingEndpoint:
    ring = codec.decode_message(_ring_decoder, data, what="ring endpoint", epoch=epoch, peer=peer)
    if ring.library != library:
        raise WireError(f"{peer} moves buckets with {ring.library!r}, this side with {library!r}")
    if ring.slots < 1 or ring.slot_bytes < 1 or ring.base <= 0:
        raise WireError(f"{peer} advertised an invalid ring ({ring.slots} slots of {ring.slot_bytes} bytes)")
    return ring


# -- the library-specific part ----------------------------------------------------------------------------------------


class PendingRead(abc.ABC):
    """A read in flight, from :meth:`RemoteRing.start_read`."""

    @abc.abstractmethod
    def wait(self, deadline: float) -> None:
        """Block (sleeping) until the bytes are in place; ``TransferError`` naming the upstream on failure or at
        ``deadline``. Called at most once."""

    def cancel(self) -> None:
        """Best effort: give up a read not waited for (the bytes of its range are then undefined)."""


class _Finished(PendingRead):
    def wait(self, deadline: float) -> None:
        pass


class RemoteRing(abc.ABC):
    """An upstream's ring, opened for one-sided reads into the local ring."""

    @abc.abstractmethod
    def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
        """Copy ``nbytes`` from the upstream's ring at ``remote_offset`` into the local ring at ``local_offset``.

        Blocks (sleeping) until done; ``TransferError`` naming the upstream on failure or at ``deadline``.
        """

    def start_read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> PendingRead:
        """Start the same read and return it in flight: the chain keeps several in flight so that the link never
        waits for a request's round trip. This default reads before returning (a library that cannot overlap
        reads); the caller waits for its reads in the order it started them."""
        self.read(local_offset=local_offset, remote_offset=remote_offset, nbytes=nbytes, deadline=deadline)
        return _Finished()

    @abc.abstractmethod
    def close(self) -> None: ...


class RegisteredRing(abc.ABC):
    """One buffer of ``slots * slot_bytes`` bytes, registered with a transfer library for the engine's lifetime."""

    library: ClassVar[str]

    def __init__(self, *, slots: int, slot_bytes: int, device: str) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.shared: SharedSegment | None = None
        if device == HOST_SHARED:
            sweep_orphan_segments()
            what = f"the two-level layout's host ring ({slots} slots of {slot_bytes / MiB:.1f} MiB)"
            self.shared = SharedSegment(f"{new_segment_prefix()}-0", slots * slot_bytes, create=True,
                                        what=what)  # pre-faulted
            self.tensor = self.shared.tensor
        else:
            # Pre-fault every page now (first touch runs at ~0.5 GB/s): updates then only ever see warm memory.
            self.tensor = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
            self.tensor.fill_(0)
        self.memory = str(self.tensor.device)

    def slot(self, index: int) -> torch.Tensor:
        return self.tensor[index * self.slot_bytes:(index + 1) * self.slot_bytes]

    @property
    def base(self) -> int:
        return int(self.tensor.data_ptr())

    def endpoint(self, *, epoch: str) -> RingEndpoint:
        agent, blob = self.identity()
        return RingEndpoint(
            wire=codec.WIRE_VERSION, epoch=epoch, library=self.library, agent=agent, blob=blob, base=self.base,
            slot_bytes=self.slot_bytes, slots=self.slots, memory=self.memory,
            segment=self.shared.name if self.shared is not None else "",
        )

    @abc.abstractmethod
    def identity(self) -> tuple[str, bytes]:
        """``(agent, blob)`` of :class:`RingEndpoint` for this process."""

    @abc.abstractmethod
    def open(self, endpoint: RingEndpoint, *, peer: str) -> RemoteRing:
        """Prepare one-sided reads from ``endpoint`` (a library connection; no memory is registered)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Deregister the ring and release the library's resources. Idempotent."""

    def free(self) -> None:
        """After ``close()``: unmap and unlink a shared ring's segment (the transport calls it). Idempotent."""
        shared, self.shared = self.shared, None
        if shared is not None:
            self.tensor = torch.empty(0, dtype=torch.uint8)  # our view must go for the mapping to close
            shared.close()
