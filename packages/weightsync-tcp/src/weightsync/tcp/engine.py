"""The ``tcp`` engine: the chain of :mod:`weightsync.core.transports.chain.transport` with reads served over plain TCP sockets.

Each engine's ring listens on a data port of its own (besides the chain's control listener). A downstream opens one
data connection to its upstream per epoch, presents the ring's secret (a random token the upstream sends in its
:class:`~weightsync.core.transports.chain.rings.RingEndpoint`, after the downstream presented the epoch token), and then
asks for byte ranges of the ring: ``(offset, nbytes)`` as two little-endian u64. The upstream answers each request, in
order, with exactly those bytes, sent by the kernel straight out of the ring (one thread per connection, blocking in
``sendall``); the downstream receives them straight into its own ring. Several requests are in flight at once, so
the link never waits for a round trip.

What it costs: one copy by the kernel on each side, no polling (every thread sleeps in a system call until its
bytes move). Where hosts have RDMA NICs, ``nixl`` moves the same bytes without the kernel; without them, UCX falls
back to TCP, and this backend relays those bytes for less CPU (docs/performance.md).
"""

from __future__ import annotations

import hmac
import secrets
import socket
import struct
import threading
import time
from collections import deque
from typing import ClassVar, NoReturn

from weightsync.api.errors import ConfigError, TransferError, WireError
from weightsync.core.backend import (
    ChainTransport,
    EngineSettings,
    PendingRead,
    RegisteredRing,
    RemoteRing,
    RingEndpoint,
    engine_class,
    memoryview_of,
)

__all__ = ["TcpCheckpointEngine", "TcpRing", "TcpTransport"]

_REQUEST = struct.Struct("<QQ")
_TOKEN_BYTES = 16
_MAX_CONNECTIONS = 256
"""Data connections one ring serves at once (a position has at most ``fanout`` readers per epoch)."""


class TcpRing(RegisteredRing):
    """A ring whose bytes a data server thread hands out to the downstreams that present its token."""

    library: ClassVar[str] = "tcp"

    def __init__(self, *, slots: int, slot_bytes: int, device: str, host_ip: str) -> None:
        super().__init__(slots=slots, slot_bytes=slot_bytes, device=device)
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = socket.create_server((host_ip, 0), backlog=64)
        self._listener.settimeout(0.2)  # the accept loop looks at _stopped this often
        self._stopped = threading.Event()
        self._accepter = threading.Thread(target=self._accept, name="ws-tcp-accept", daemon=True)
        self._accepter.start()

    def identity(self) -> tuple[str, bytes]:
        listener = self._listener
        if listener is None:
            raise TransferError("tcp ring is closed", peer="this engine")
        host, port = listener.getsockname()[:2]
        return f"{host}:{port}", self._token

    def _accept(self) -> None:
        while not self._stopped.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:  # closed under us
                return
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()]
                if self._stopped.is_set() or len(self._connections) >= _MAX_CONNECTIONS:
                    conn.close()
                    continue
                self._connections.add(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="ws-tcp-serve", daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer one downstream's requests in order until it hangs up, asks for bytes outside the ring, or the
        ring closes. A connection that does not present the token within a second is dropped."""
        try:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(1.0)
            if not hmac.compare_digest(_recv_exactly(conn, _TOKEN_BYTES), self._token):
                return
            conn.settimeout(None)  # idle between updates for as long as the epoch lasts; close() wakes it
            size = self.slots * self.slot_bytes
            ring = memoryview_of(self.tensor)
            while not self._stopped.is_set():
                offset, nbytes = _REQUEST.unpack(_recv_exactly(conn, _REQUEST.size))
                if nbytes == 0 or offset + nbytes > size:
                    return
                conn.sendall(ring[offset:offset + nbytes])
        except (OSError, EOFError):  # the downstream went away or the ring is closing
            return
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def open(self, endpoint: RingEndpoint, *, peer: str) -> RemoteRing:
        host, _, port = endpoint.agent.rpartition(":")
        if not host or not port.isdigit() or len(endpoint.blob) != _TOKEN_BYTES:
            raise WireError(f"{peer} advertised an invalid tcp ring endpoint {endpoint.agent!r}")
        try:
            sock = socket.create_connection((host, int(port)), timeout=10.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(endpoint.blob)
        except OSError as exc:
            raise TransferError(f"could not open the data connection to {peer} at {endpoint.agent}: {exc}",
                                peer=peer) from None
        return _TcpRemote(sock, self, endpoint, peer)

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            listener, self._listener = self._listener, None
            connections = list(self._connections)
            threads = list(self._threads)
        if listener is not None:
            listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv or sendall
            except OSError:
                pass
        self._accepter.join(timeout=5)
        for thread in threads:
            thread.join(timeout=5)


class _TcpRead(PendingRead):
    def __init__(self, remote: _TcpRemote, local_offset: int, nbytes: int) -> None:
        self._remote, self.local_offset, self.nbytes = remote, local_offset, nbytes

    def wait(self, deadline: float) -> None:
        self._remote.receive(self, deadline)

    def cancel(self) -> None:
        self._remote.abandon()


class _TcpRemote(RemoteRing):
    """One data connection to an upstream's ring. Answers arrive in the order of the requests, so reads are
    waited for in the order they were started; a read given up leaves its bytes on the wire, so the connection is
    then closed and every later read fails."""

    def __init__(self, sock: socket.socket, ring: TcpRing, endpoint: RingEndpoint, peer: str) -> None:
        self._sock, self._ring, self._peer = sock, ring, peer
        self._size = endpoint.slots * endpoint.slot_bytes
        self._posted: deque[_TcpRead] = deque()
        self._broken = ""

    def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
        self.start_read(local_offset=local_offset, remote_offset=remote_offset, nbytes=nbytes,
                        deadline=deadline).wait(deadline)

    def start_read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> PendingRead:
        if nbytes <= 0 or remote_offset < 0 or remote_offset + nbytes > self._size:
            raise WireError(f"a read of {nbytes} bytes at {remote_offset} is outside {self._peer}'s ring")
        self._usable()
        try:
            self._sock.settimeout(_left(deadline, self._peer, what="asking for bytes from"))
            self._sock.sendall(_REQUEST.pack(remote_offset, nbytes))
        except OSError as exc:
            self._fail(f"asking {self._peer} for {nbytes} bytes failed: {exc}")
        pending = _TcpRead(self, local_offset, nbytes)
        self._posted.append(pending)
        return pending

    def receive(self, pending: _TcpRead, deadline: float) -> None:
        self._usable()
        if not self._posted or self._posted[0] is not pending:
            self._fail("tcp reads must be waited for in the order they were started")
        start = pending.local_offset
        view = memoryview_of(self._ring.tensor, writable=True)[start:start + pending.nbytes]
        got = 0
        try:
            while got < pending.nbytes:
                self._sock.settimeout(_left(deadline, self._peer, what=f"reading {pending.nbytes} bytes from"))
                count = self._sock.recv_into(view[got:])
                if count == 0:
                    self._fail(f"{self._peer} closed the data connection", closed=True)
                got += count
        except TransferError:
            self.abandon()
            raise
        except OSError as exc:
            self._fail(f"reading {pending.nbytes} bytes from {self._peer} failed: {exc}")
        self._posted.popleft()

    def _usable(self) -> None:
        if self._broken:
            raise TransferError(f"the data connection to {self._peer} was given up ({self._broken})", peer=self._peer)

    def _fail(self, message: str, *, closed: bool = False) -> NoReturn:
        self.abandon(message)
        raise TransferError(message, peer=self._peer, closed=closed)

    def abandon(self, why: str = "a read was cancelled") -> None:
        if not self._broken:
            self._broken = why
        self._posted.clear()
        self._sock.close()

    def close(self) -> None:
        self.abandon("closed")


def _left(deadline: float, peer: str, *, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"timed out {what} {peer}", peer=peer)
    return left


def _recv_exactly(conn: socket.socket, nbytes: int) -> bytes:
    data = bytearray()
    while len(data) < nbytes:
        chunk = conn.recv(nbytes - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class TcpTransport(ChainTransport):
    """The chain over TCP. Options: those of the chain transport; the ring is always in host memory (tensors on an
    accelerator are staged through it), so ``device`` may only be ``"cpu"``."""

    name: ClassVar[str] = "tcp"
    library: ClassVar[str] = "tcp"

    def __init__(self, settings: EngineSettings) -> None:
        if settings.options.get("device", "cpu") != "cpu":
            raise ConfigError(f"tcp: the ring is in host memory (the kernel's sockets read and write it); device must "
                              f"be 'cpu', got {settings.options['device']!r} (tensors on any device are staged "
                              f"through it)")
        super().__init__(settings)

    def make_ring(self) -> RegisteredRing:
        return TcpRing(slots=self.settings.slots, slot_bytes=self.settings.bucket_bytes, device=self.ring_device,
                       host_ip=self.settings.rail_address)


TcpCheckpointEngine = engine_class(TcpTransport)
