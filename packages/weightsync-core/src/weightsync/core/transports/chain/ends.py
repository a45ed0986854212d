"""The chain's two kinds of position (:mod:`weightsync.core.transports.chain.transport`): the sender, and a receiver
that reads from its upstream and, as a relay, lets its children read from it.

A receiver reads each bucket in pieces with several reads in flight (:meth:`RemoteRing.start_read`), so the link
does not idle for a request's round trip; a relay with a child across the network announces each piece as it lands
(cut-through), so a hop adds one piece's time to an update, not one bucket's. Children that read in place (the
two-level layout's same-host workers) wait for whole buckets.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from weightsync.api.errors import TransferError, WeightsyncError, WireError
from weightsync.core.transports.chain.rings import BucketReady, PendingRead, RegisteredRing, RemoteRing, RingEndpoint, decode_ready
from weightsync.core.transports.seam import NO_SLOT, ReceivedBucket
from weightsync.core.transports.waiting import AckedPeers, SlotSequence
from weightsync.core.wire import codec
from weightsync.core.wire.framing import recv_frame, send_frame

__all__ = ["MAX_CONTROL_FRAME", "RELAY_PIECE_BYTES", "READS_IN_FLIGHT", "ChainReceiver", "ChainSender", "Downstream",
           "Upstream"]

MAX_CONTROL_FRAME = 1 << 20  # headers of buckets with many tensors stay far below this

RELAY_PIECE_BYTES = 1 << 20
"""A receiver reads a bucket in pieces of this size, and a relay announces each downstream as it lands
(cut-through): each hop adds one piece's time to an update rather than one bucket's (1 MiB: 4 ms on a 2 Gb/s
link)."""

READS_IN_FLIGHT = 16
"""Pieces a receiver keeps in flight: the link never idles for a request's round trip between two reads."""


def _pending(sock: socket.socket) -> bool:
    """Bytes are waiting on ``sock`` (an announcement has arrived, or the peer closed). ``poll``, not ``select``:
    a process with many files (a Ray worker) may hold descriptors past select's limit of 1024."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


# -- the control plane's two ends ------------------------------------------------------------------------------------


class Downstream:
    """The connections to the positions that read from this one: announcements out, read acknowledgements in."""

    def __init__(self, children: list[tuple[str, socket.socket]], epoch: str, *, in_place: frozenset[str] = frozenset()
                 ) -> None:
        self.reads = AckedPeers(children, epoch)
        self.epoch = epoch
        self._in_place = in_place

    @property
    def relaying(self) -> bool:
        """A child reads this position's ring over the network (and is not lost): pieces are worth announcing.
        Children reading in place (the two-level layout's same-host workers) wait for whole buckets."""
        return any(name not in self._in_place and name not in self.reads.lost for name, _ in self.reads.peers)

    def announce(self, *, seq: int, slot: int, nbytes: int, header: bytes, deadline: float,
                 available: int = -1) -> None:
        frame = codec.encode(BucketReady(wire=codec.WIRE_VERSION, epoch=self.epoch, seq=seq, slot=slot,
                                         nbytes=nbytes, header=header, available=available))
        self.reads.send_all(frame, deadline)

    def abort(self, message: str) -> None:
        """Best effort: tell children this position failed, so they stop now rather than at their deadline."""
        header = codec.encode(codec.BucketHeader(
            wire=codec.WIRE_VERSION, epoch=self.epoch, version=0, sender=0, index=0, slot=NO_SLOT, nbytes=0,
            tensors=[], abort=message[:500] or "aborted",
        ))
        try:
            self.announce(seq=0, slot=NO_SLOT, nbytes=0, header=header, deadline=time.monotonic() + 2.0)
        except WeightsyncError:
            pass

    def close(self) -> None:
        self.reads.close()


class ChainSender:
    """``SenderTransport`` of position 0: pack into the local ring, announce, reuse a slot once children read it."""

    def __init__(self, ring: RegisteredRing, downstream: Downstream) -> None:
        self.slots = ring.slots
        self.capacity = ring.slot_bytes
        self._ring = ring
        self._downstream = downstream
        self._sequence = SlotSequence(ring.slots)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._ring.slot(slot)

    def wait_slot(self, slot: int, deadline: float) -> None:
        self._downstream.reads.wait(self._sequence.last(slot), deadline)

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        # One-sided: children pull the bytes; wait_slot keeps the slot intact until they have.
        seq = self._sequence.publish(slot) if slot != NO_SLOT else 0
        self._downstream.announce(seq=seq, slot=slot, nbytes=nbytes, header=header, deadline=deadline)

    def close(self) -> None:
        self._downstream.close()


@dataclass
class Upstream:
    """The position this one reads from: its control connection and its ring, opened for one-sided reads."""

    sock: socket.socket
    name: str
    remote: RemoteRing
    ring: RingEndpoint

    def close(self) -> None:
        self.sock.close()
        self.remote.close()


class ChainReceiver:
    """``ReceiverTransport`` of a rollout position: read from upstream into the local ring, forward, hand over."""

    def __init__(self, *, ring: RegisteredRing, upstream: Upstream, downstream: Downstream, epoch: str, rank: int,
                 piece_bytes: int = RELAY_PIECE_BYTES) -> None:
        self.capacity = ring.slot_bytes
        self._piece_bytes = piece_bytes
        self._ring, self._upstream, self._downstream = ring, upstream, downstream
        self._epoch, self._rank = epoch, rank
        self._received = self._released = 0
        self._sequence = SlotSequence(ring.slots)
        self._consumer = threading.Condition()

    def receive(self, deadline: float) -> ReceivedBucket:
        try:
            return self._receive(deadline)
        except BaseException as exc:
            self._downstream.abort(f"rollout rank {self._rank} failed to receive: {type(exc).__name__}: {exc}")
            raise

    def _receive(self, deadline: float) -> ReceivedBucket:
        ready = self._next(deadline)
        if ready.slot == NO_SLOT:
            # The final or abort marker: pass it down the chain, no payload to read.
            self._downstream.announce(seq=0, slot=NO_SLOT, nbytes=0, header=ready.header, deadline=deadline)
            return ReceivedBucket(header=ready.header, payload=torch.empty(0, dtype=torch.uint8), token=0)
        remote, peer = self._upstream.ring, self._upstream.name
        if ready.seq != self._received + 1:
            raise WireError(f"{peer} announced bucket {ready.seq} after {self._received}")
        if not 0 <= ready.slot < remote.slots or not 0 <= ready.nbytes <= min(remote.slot_bytes, self.capacity):
            raise WireError(f"{peer} announced {ready.nbytes} bytes in slot {ready.slot}, outside the rings")
        seq = self._received = ready.seq
        slot = (seq - 1) % self._ring.slots
        self._wait_consumer(self._sequence.last(slot), deadline)
        self._downstream.reads.wait(self._sequence.last(slot), deadline)
        ready = self._read(ready, slot, deadline)
        ack = codec.Ack(wire=codec.WIRE_VERSION, epoch=self._epoch, rank=self._rank, index=seq)
        send_frame(self._upstream.sock, codec.encode(ack), deadline=deadline, peer=peer)
        self._sequence.record(slot, seq)
        self._downstream.announce(seq=seq, slot=slot, nbytes=ready.nbytes, header=ready.header, deadline=deadline)
        return ReceivedBucket(header=ready.header, payload=self._ring.slot(slot)[:ready.nbytes], token=seq)

    def _next(self, deadline: float) -> BucketReady:
        upstream = self._upstream
        frame = recv_frame(upstream.sock, deadline=deadline, peer=upstream.name, max_len=MAX_CONTROL_FRAME)
        return decode_ready(frame, epoch=self._epoch, peer=upstream.name)

    def _read(self, ready: BucketReady, slot: int, deadline: float) -> BucketReady:
        """Read bucket ``ready.seq`` into ``slot`` in pieces of at most ``relay_piece_bytes``, up to
        ``READS_IN_FLIGHT`` of them at once, as the upstream makes them available; a relay announces each piece to
        its children as it lands. Returns the complete announcement."""
        upstream, relaying = self._upstream, self._downstream.relaying
        local, remote = slot * self._ring.slot_bytes, ready.slot * upstream.ring.slot_bytes
        in_flight: deque[tuple[int, PendingRead]] = deque()  # (end offset, read), oldest first
        posted = 0
        try:
            while True:
                while posted < ready.readable and len(in_flight) < READS_IN_FLIGHT:
                    piece = min(self._piece_bytes, ready.readable - posted)
                    in_flight.append((posted + piece, upstream.remote.start_read(
                        local_offset=local + posted, remote_offset=remote + posted, nbytes=piece, deadline=deadline)))
                    posted += piece
                if not in_flight and ready.complete:
                    return ready
                # Wait for the oldest read unless the upstream may have more of this bucket to offer now.
                if in_flight and (ready.complete or posted < ready.readable or not _pending(upstream.sock)):
                    end, read = in_flight.popleft()
                    read.wait(deadline)
                    if relaying and end < ready.nbytes:
                        self._downstream.announce(seq=ready.seq, slot=slot, nbytes=ready.nbytes, header=b"",
                                                  deadline=deadline, available=end)
                    continue
                ready = self._more(ready, deadline)
        finally:
            for _, read in in_flight:
                read.cancel()

    def _more(self, ready: BucketReady, deadline: float) -> BucketReady:
        """The upstream's next announcement, which must offer more of the bucket ``ready`` is part of."""
        more = self._next(deadline)
        if more.slot == NO_SLOT:
            # The upstream failed mid-bucket and says so (Downstream.abort): its reason, not a protocol error.
            header, _ = codec.decode_bucket(more.header, epoch=self._epoch, capacity=0)
            raise TransferError(f"{self._upstream.name} aborted the update while bucket {ready.seq} was arriving: "
                                f"{header.abort or 'no reason given'}", peer=self._upstream.name)
        if (more.seq, more.slot, more.nbytes) != (ready.seq, ready.slot, ready.nbytes) or (
                not more.complete and more.available <= ready.available):
            raise WireError(f"{self._upstream.name} announced bucket {more.seq} ({more.available} of {more.nbytes} "
                            f"bytes) while bucket {ready.seq} was arriving")
        return more

    def _wait_consumer(self, seq: int, deadline: float) -> None:
        with self._consumer:
            while self._released < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"rollout rank {self._rank}: the local consumer did not release bucket {seq} "
                                        f"in time", peer=f"rollout rank {self._rank} (local consumer)")
                self._consumer.wait(left)

    def release(self, token: int) -> None:
        if token <= 0:
            return
        with self._consumer:
            self._released = max(self._released, token)
            self._consumer.notify_all()

    def close(self) -> None:
        self._upstream.sock.close()
        self._downstream.close()
        self._upstream.remote.close()
