"""A chain position that shares its upstream's host: it reads each bucket in place from the upstream's ring.

The two-level layout (:mod:`weightsync.core.transports.chain.topology`) gives every host one leader that receives over
the network into a ring in shared memory (``HOST_SHARED``); the host's other workers map that ring and hand its slots
straight to their consumers: no transfer library, no copy of their own. The upstream announces buckets exactly as
to any child (``BucketReady`` on the control connection); a local reader acknowledges a bucket once its consumer
has released it — not once it has read it, as a remote child does — because until then the consumer still reads
the upstream's slot, which the upstream must not overwrite.
"""

from __future__ import annotations

import socket
import time

import torch

from weightsync.api.errors import TopologyError, WireError
from weightsync.core.transports.chain.rings import RingEndpoint, decode_ready
from weightsync.core.transports.sharedmem import SharedSegment
from weightsync.core.transports.seam import NO_SLOT, ReceivedBucket
from weightsync.core.wire import codec
from weightsync.core.wire.framing import recv_frame, send_frame

__all__ = ["HostRingReader", "map_upstream_ring"]

MAX_CONTROL_FRAME = 1 << 20


def map_upstream_ring(endpoint: RingEndpoint, *, peer: str, node: str) -> SharedSegment:
    """Map ``peer``'s shared ring; ``TopologyError`` if it is not shared or not on this host (``node``)."""
    if not endpoint.segment:
        raise TopologyError(f"{peer} does not share its ring (it was not built for the two-level layout)")
    try:
        return SharedSegment(endpoint.segment, endpoint.slots * endpoint.slot_bytes, create=False)
    except FileNotFoundError:
        raise TopologyError(f"{peer}'s ring {endpoint.segment} is not in this host's shared memory: the two-level "
                            f"layout placed it on this worker's node {node!r}, but it runs on another host") from None


class HostRingReader:
    """``ReceiverTransport`` of a worker that reads its host leader's ring in place (``rank``: its rollout rank)."""

    def __init__(self, *, sock: socket.socket, peer: str, ring: SharedSegment, endpoint: RingEndpoint, epoch: str,
                 rank: int, timeout: float) -> None:
        self.capacity = endpoint.slot_bytes
        self._sock, self._peer, self._ring, self._endpoint = sock, peer, ring, endpoint
        self._epoch, self._rank, self._timeout = epoch, rank, timeout
        self._received = 0

    def receive(self, deadline: float) -> ReceivedBucket:
        while True:  # a relaying leader announces pieces as they land; this reader wants whole buckets
            ready = decode_ready(recv_frame(self._sock, deadline=deadline, peer=self._peer,
                                            max_len=MAX_CONTROL_FRAME), epoch=self._epoch, peer=self._peer)
            if ready.complete:
                break
            if ready.seq != self._received + 1:
                raise WireError(f"{self._peer} announced part of bucket {ready.seq} after {self._received}")
        if ready.slot == NO_SLOT:
            return ReceivedBucket(header=ready.header, payload=torch.empty(0, dtype=torch.uint8), token=0)
        ring = self._endpoint
        if ready.seq != self._received + 1:
            raise WireError(f"{self._peer} announced bucket {ready.seq} after {self._received}")
        if not 0 <= ready.slot < ring.slots or not 0 <= ready.nbytes <= ring.slot_bytes:
            raise WireError(f"{self._peer} announced {ready.nbytes} bytes in slot {ready.slot}, outside its ring")
        self._received = ready.seq
        start = ready.slot * ring.slot_bytes
        return ReceivedBucket(header=ready.header, payload=self._ring.tensor[start:start + ready.nbytes],
                              token=ready.seq)

    def release(self, token: int) -> None:
        if token <= 0:
            return
        ack = codec.Ack(wire=codec.WIRE_VERSION, epoch=self._epoch, rank=self._rank, index=token)
        send_frame(self._sock, codec.encode(ack), deadline=time.monotonic() + self._timeout, peer=self._peer)

    def close(self) -> None:
        self._sock.close()
        self._ring.close()
