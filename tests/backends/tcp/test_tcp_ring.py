"""The tcp backend's ring, in one process over the loopback: what its data server hands out, to whom, and how a
read fails. Bytes are compared raw; the server is probed with plain sockets from outside the backend's code."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from weightsync.api.errors import TransferError, WireError
from weightsync.core.transports.chain.rings import RingEndpoint
from weightsync.tcp.engine import TcpRing

SLOTS, SLOT_BYTES = 2, 1 << 20
REQUEST = struct.Struct("<QQ")


@pytest.fixture
def rings() -> Iterator[tuple[TcpRing, TcpRing]]:
    upstream = TcpRing(slots=SLOTS, slot_bytes=SLOT_BYTES, device="cpu", host_ip="127.0.0.1")
    local = TcpRing(slots=SLOTS, slot_bytes=SLOT_BYTES, device="cpu", host_ip="127.0.0.1")
    upstream.tensor.copy_(torch.randint(0, 256, (SLOTS * SLOT_BYTES,), dtype=torch.uint8))
    try:
        yield upstream, local
    finally:
        upstream.close()
        local.close()


def _address(ring: TcpRing) -> tuple[str, int]:
    host, _, port = ring.identity()[0].rpartition(":")
    return host, int(port)


def _ask(ring: TcpRing, token: bytes, offset: int, nbytes: int) -> bytes:
    """A raw client: present ``token``, ask for one range, return whatever comes back before the server hangs up
    or 2 s pass."""
    with socket.create_connection(_address(ring), timeout=2.0) as sock:
        sock.sendall(token + REQUEST.pack(offset, nbytes))
        got = bytearray()
        try:
            while len(got) < nbytes:
                chunk = sock.recv(nbytes - len(got))
                if not chunk:
                    break
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return bytes(got)


def test_reads_in_flight_land_bit_exact(rings: tuple[TcpRing, TcpRing]) -> None:
    upstream, local = rings
    remote = local.open(upstream.endpoint(epoch="e"), peer="rollout rank 0")
    deadline = time.monotonic() + 10
    piece = SLOT_BYTES // 16
    reads = [remote.start_read(local_offset=SLOT_BYTES + i * piece, remote_offset=i * piece, nbytes=piece,
                               deadline=deadline) for i in range(16)]
    for read in reads:
        read.wait(deadline)
    assert bytes(local.tensor[SLOT_BYTES:].numpy()) == bytes(upstream.tensor[:SLOT_BYTES].numpy())
    remote.close()


def test_only_the_rings_token_gets_bytes(rings: tuple[TcpRing, TcpRing]) -> None:
    upstream, _ = rings
    token = upstream.identity()[1]
    wanted = bytes(upstream.tensor[:4096].numpy())
    assert _ask(upstream, token, 0, 4096) == wanted  # negative control: the right token is served
    assert _ask(upstream, bytes(16), 0, 4096) == b""
    assert _ask(upstream, token[:-1] + bytes([token[-1] ^ 1]), 0, 4096) == b""


def test_a_range_outside_the_ring_ends_the_connection(rings: tuple[TcpRing, TcpRing]) -> None:
    upstream, local = rings
    token = upstream.identity()[1]
    assert _ask(upstream, token, SLOTS * SLOT_BYTES - 10, 20) == b""
    assert _ask(upstream, token, SLOTS * SLOT_BYTES - 10, 10) == bytes(upstream.tensor[-10:].numpy())  # control
    remote = local.open(upstream.endpoint(epoch="e"), peer="rollout rank 0")
    with pytest.raises(WireError, match="outside rollout rank 0's ring"):
        remote.start_read(local_offset=0, remote_offset=SLOTS * SLOT_BYTES, nbytes=1, deadline=time.monotonic() + 5)
    remote.close()


def test_a_silent_upstream_times_out_naming_it_and_the_connection_is_given_up(rings: tuple[TcpRing, TcpRing]
                                                                              ) -> None:
    """A peer that accepts and never answers: the read fails at its deadline (not later), names the peer, and the
    connection is not reused (the next read would get the late bytes of the one given up)."""
    _, local = rings
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        endpoint = RingEndpoint(wire=1, epoch="e", library="tcp", agent=f"127.0.0.1:{port}", blob=bytes(16),
                                base=1, slot_bytes=SLOT_BYTES, slots=SLOTS)
        remote = local.open(endpoint, peer="rollout rank 4")
        start = time.monotonic()
        read = remote.start_read(local_offset=0, remote_offset=0, nbytes=4096, deadline=start + 0.5)
        with pytest.raises(TransferError, match="rollout rank 4") as caught:
            read.wait(start + 0.5)
        assert 0.45 < time.monotonic() - start < 2.0
        assert caught.value.peer == "rollout rank 4" and not caught.value.closed
        with pytest.raises(TransferError, match="given up"):
            remote.start_read(local_offset=0, remote_offset=0, nbytes=4096, deadline=time.monotonic() + 5)


def test_an_upstream_that_closes_is_reported_closed(rings: tuple[TcpRing, TcpRing]) -> None:
    upstream, local = rings
    endpoint = upstream.endpoint(epoch="e")
    remote = local.open(endpoint, peer="actor rank 0")
    remote.read(local_offset=0, remote_offset=0, nbytes=4096, deadline=time.monotonic() + 5)  # control: it serves
    upstream.close()
    with pytest.raises(TransferError) as caught:
        remote.read(local_offset=0, remote_offset=0, nbytes=4096, deadline=time.monotonic() + 5)
    assert caught.value.peer == "actor rank 0" and caught.value.closed


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_close_leaves_no_thread_or_socket() -> None:
    """Counted from outside: the process's threads by name and its open descriptors."""
    before_fds = _fds()
    upstream = TcpRing(slots=SLOTS, slot_bytes=SLOT_BYTES, device="cpu", host_ip="127.0.0.1")
    local = TcpRing(slots=SLOTS, slot_bytes=SLOT_BYTES, device="cpu", host_ip="127.0.0.1")
    remote = local.open(upstream.endpoint(epoch="e"), peer="rollout rank 0")
    remote.read(local_offset=0, remote_offset=0, nbytes=4096, deadline=time.monotonic() + 5)
    assert sum(t.name.startswith("ws-tcp-") for t in threading.enumerate()) == 3  # 2 accept loops, 1 server
    assert _fds() > before_fds  # control: the count sees them
    remote.close()
    upstream.close()
    local.close()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ws-tcp-")]
    assert _fds() == before_fds
