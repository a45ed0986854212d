"""How a chain receiver reads a bucket (weightsync.core.transports.chain.ends): in pieces, several in flight, announcing
pieces downstream only when a child reads over the network. In one process: the upstream is a socket pair the test
writes announcements into, its ring a tensor read by a RemoteRing that records every read it is asked for."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightsync.api.errors import TransferError
from weightsync.core.transports.chain.ends import READS_IN_FLIGHT, ChainReceiver, Downstream, Upstream
from weightsync.core.transports.chain.rings import BucketReady, PendingRead, RegisteredRing, RemoteRing, RingEndpoint, decode_ready
from weightsync.core.wire import codec
from weightsync.core.wire.framing import recv_frame, send_frame

EPOCH = "e" * 16
PIECE = 4096
SLOT = 16 * PIECE


class _Ring(RegisteredRing):
    library = "test"

    def identity(self) -> tuple[str, bytes]:
        return "test", b""

    def open(self, endpoint: RingEndpoint, *, peer: str) -> RemoteRing:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Read(PendingRead):
    def __init__(self, remote: _Remote, local: int, offset: int, nbytes: int) -> None:
        self.remote, self.local, self.offset, self.nbytes = remote, local, offset, nbytes

    def wait(self, deadline: float) -> None:
        # The bytes land when waited for: a read not waited for has not delivered them.
        target = self.remote.local.tensor
        target[self.local:self.local + self.nbytes] = self.remote.source[self.offset:self.offset + self.nbytes]
        self.remote.in_flight -= 1

    def cancel(self) -> None:
        self.remote.in_flight -= 1


class _Remote(RemoteRing):
    """Reads from ``source``, keeping count of the reads started and not yet waited for."""

    def __init__(self, local: _Ring, source: torch.Tensor) -> None:
        self.local, self.source = local, source
        self.in_flight = self.most_in_flight = 0
        self.sizes: list[int] = []

    def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
        raise AssertionError("the receiver starts reads; it never blocks on one")

    def start_read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> PendingRead:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        self.sizes.append(nbytes)
        return _Read(self, local_offset, remote_offset, nbytes)

    def close(self) -> None:
        pass


def ready(seq: int, *, available: int = -1, header: bytes = b"") -> bytes:
    return codec.encode(BucketReady(wire=codec.WIRE_VERSION, epoch=EPOCH, seq=seq, slot=0, nbytes=SLOT,
                                    header=header, available=available))


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for sock in made:
        sock.close()


def receiver(sockets: list[socket.socket], *, network_child: bool
             ) -> tuple[ChainReceiver, _Remote, socket.socket, socket.socket]:
    upstream_end, ours = socket.socketpair()
    child_end, to_child = socket.socketpair()
    sockets += [upstream_end, ours, child_end, to_child]
    ring = _Ring(slots=2, slot_bytes=SLOT, device="cpu")
    source = torch.randint(0, 256, (2 * SLOT,), dtype=torch.uint8)
    remote = _Remote(ring, source)
    endpoint = RingEndpoint(wire=codec.WIRE_VERSION, epoch=EPOCH, library="test", agent="up", blob=b"", base=1,
                            slot_bytes=SLOT, slots=2)
    in_place = frozenset() if network_child else frozenset({"rollout rank 1"})
    downstream = Downstream([("rollout rank 1", to_child)], EPOCH, in_place=in_place)
    return (ChainReceiver(ring=ring, upstream=Upstream(ours, "actor rank 0", remote, endpoint),
                          downstream=downstream, epoch=EPOCH, rank=0, piece_bytes=PIECE),
            remote, upstream_end, child_end)


def announcements(child_end: socket.socket) -> list[BucketReady]:
    seen: list[BucketReady] = []
    child_end.settimeout(0.2)
    while True:
        try:
            frame = recv_frame(child_end, deadline=time.monotonic() + 0.2, peer="child", max_len=1 << 20)
        except Exception:
            return seen
        seen.append(decode_ready(frame, epoch=EPOCH, peer="child"))


def test_a_whole_bucket_is_read_in_pieces_with_many_in_flight(sockets: list[socket.socket]) -> None:
    chain, remote, upstream_end, child_end = receiver(sockets, network_child=False)
    send_frame(upstream_end, ready(1, header=b"h"), deadline=time.monotonic() + 5, peer="test")
    bucket = chain.receive(time.monotonic() + 5)
    assert bytes(bucket.payload.numpy()) == bytes(remote.source[:SLOT].numpy())
    assert remote.sizes == [PIECE] * (SLOT // PIECE)
    assert remote.most_in_flight == min(READS_IN_FLIGHT, SLOT // PIECE) > 1
    # The only child reads in place: it hears of the bucket once, whole.
    assert [(r.seq, r.available) for r in announcements(child_end)] == [(1, -1)]


def test_a_relay_follows_its_upstream_piece_by_piece(sockets: list[socket.socket]) -> None:
    chain, remote, upstream_end, child_end = receiver(sockets, network_child=True)
    deadline = time.monotonic() + 5
    # The upstream is itself a relay: it offers the bucket in three steps, then whole.
    steps = [ready(1, available=3 * PIECE), ready(1, available=10 * PIECE), ready(1, header=b"h")]

    def upstream() -> None:
        for frame in steps:
            send_frame(upstream_end, frame, deadline=deadline, peer="test")
            time.sleep(0.05)

    writer = threading.Thread(target=upstream)
    writer.start()
    bucket = chain.receive(deadline)
    writer.join()
    assert bytes(bucket.payload.numpy()) == bytes(remote.source[:SLOT].numpy())
    seen = announcements(child_end)
    assert [r.available for r in seen] == [PIECE * k for k in range(1, SLOT // PIECE)] + [-1]
    assert seen[-1].header == b"h" and all(r.header == b"" for r in seen[:-1])


def test_the_pipeline_checker_can_fail() -> None:
    """Negative control: a remote that reads blocking (the RemoteRing default) never has two in flight."""

    class Blocking(_Remote):
        def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
            self.sizes.append(nbytes)

        start_read = RemoteRing.start_read

    ring = _Ring(slots=1, slot_bytes=SLOT, device="cpu")
    remote = Blocking(ring, torch.zeros(SLOT, dtype=torch.uint8))
    for offset in range(0, SLOT, PIECE):
        remote.start_read(local_offset=offset, remote_offset=offset, nbytes=PIECE, deadline=time.monotonic() + 1)
    assert remote.most_in_flight == 0


def test_an_upstream_aborting_mid_bucket_is_reported_with_its_reason(sockets: list[socket.socket]) -> None:
    chain, _, upstream_end, child_end = receiver(sockets, network_child=True)
    deadline = time.monotonic() + 5
    send_frame(upstream_end, ready(1, available=2 * PIECE), deadline=deadline, peer="test")
    # What a failing relay sends its children (Downstream.abort), from the upstream's end of the socket.
    Downstream([("rollout rank 0", upstream_end)], EPOCH).abort("rollout rank 7 failed to receive: boom")
    with pytest.raises(TransferError, match="aborted the update while bucket 1 was arriving: rollout rank 7 failed"):
        chain.receive(deadline)
    # And this position passes the failure on to its own children.
    assert announcements(child_end)[-1].slot < 0
