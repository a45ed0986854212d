"""Length-prefixed frames on a stream socket, with deadlines: the control channel of socket-based transports.

A frame is a 4-byte little-endian length followed by that many bytes (at most ``MAX_FRAME``). Every read and write
takes an absolute deadline (``time.monotonic()``) and raises ``TransferError`` naming the peer when it passes or
when the peer goes away; a blocked call sleeps in the kernel, it never spins.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Callable, Sequence

from weightsync.api.errors import TransferError, WireError
from weightsync.core.wire.codec import Hello, decode_hello

__all__ = ["MAX_FRAME", "send_frame", "recv_frame", "accept_peers"]

log = logging.getLogger(__name__)

MAX_FRAME = 64 << 20

# The peer's end is gone (its process exited or was killed): such a TransferError carries ``closed=True``.
_CLOSED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _remaining(deadline: float, peer: str, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"timed out {what} {peer}", peer=peer)
    return left


def send_frame(sock: socket.socket, payload: bytes, *, deadline: float, peer: str) -> None:
    if len(payload) > MAX_FRAME:
        raise WireError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
    data = len(payload).to_bytes(4, "little") + payload
    try:
        sock.settimeout(_remaining(deadline, peer, "sending to"))
        sock.sendall(data)
    except socket.timeout:
        raise TransferError(f"timed out sending to {peer}", peer=peer) from None
    except OSError as exc:
        raise TransferError(f"connection to {peer} failed while sending: {exc}", peer=peer,
                            closed=isinstance(exc, _CLOSED)) from None


def _recv_exact(sock: socket.socket, size: int, *, deadline: float, peer: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        try:
            sock.settimeout(_remaining(deadline, peer, "waiting for"))
            chunk = sock.recv(size - len(chunks))
        except socket.timeout:
            raise TransferError(f"timed out waiting for {peer}", peer=peer) from None
        except OSError as exc:
            raise TransferError(f"connection to {peer} failed while receiving: {exc}", peer=peer,
                                closed=isinstance(exc, _CLOSED)) from None
        if not chunk:
            raise TransferError(f"{peer} closed the connection", peer=peer, closed=True)
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, *, deadline: float, peer: str, max_len: int = MAX_FRAME) -> bytes:
    length = int.from_bytes(_recv_exact(sock, 4, deadline=deadline, peer=peer), "little")
    if length > max_len:
        raise WireError(f"{peer} announced a {length}-byte frame (limit {max_len})")
    return _recv_exact(sock, length, deadline=deadline, peer=peer)


def accept_peers(
    listener: socket.socket, *, ranks: Sequence[int], epoch: str, deadline: float, reply: Callable[[Hello], bytes],
    what: str, hello_seconds: float = 5.0,
) -> list[socket.socket]:
    """Accept one connection per rank of ``ranks``, each opening with a ``Hello`` for ``epoch`` and its rank.

    Connections are served concurrently (a selector), so a stranger that connects and says nothing, or sends garbage,
    a forged hello or a bucket header, delays nobody: it is logged and dropped (after ``hello_seconds`` at most),
    and the wait goes on for the real peers. ``reply`` builds the frame sent back to an accepted peer. Returns the
    sockets in the order of ``ranks``, blocking; raises ``TransferError`` naming the ranks missing at ``deadline``.
    """
    peers: dict[int, socket.socket | None] = {rank: None for rank in ranks}
    pending: dict[socket.socket, tuple[bytearray, float]] = {}
    selector = selectors.DefaultSelector()
    listener.setblocking(False)
    selector.register(listener, selectors.EVENT_READ)

    def drop(sock: socket.socket, reason: str) -> None:
        log.warning("%s: rejected a connection: %s", what, reason)
        pending.pop(sock, None)
        selector.unregister(sock)
        sock.close()

    try:
        while any(peer is None for peer in peers.values()):
            now = time.monotonic()
            if now >= deadline:
                missing = [rank for rank, peer in peers.items() if peer is None]
                raise TransferError(f"{what}: ranks {missing} did not connect in time", peer=f"ranks {missing}")
            for expired in [sock for sock, (_, expires) in pending.items() if now >= expires]:
                drop(expired, "no hello in time")
            for key, _ in selector.select(min(deadline - now, 0.5)):
                if key.fileobj is listener:
                    _accept_one(listener, selector, pending, hello_seconds)
                    continue
                sock = key.fileobj
                if not isinstance(sock, socket.socket):
                    continue
                try:
                    hello = _read_hello(sock, pending[sock][0], epoch=epoch, peers=peers)
                except WireError as exc:
                    drop(sock, str(exc))
                    continue
                if hello is None:
                    continue
                pending.pop(sock)
                selector.unregister(sock)
                sock.setblocking(True)
                send_frame(sock, reply(hello), deadline=deadline, peer=f"rank {hello.rank}")
                peers[hello.rank] = sock
    except BaseException:
        for peer in [*peers.values(), *pending]:
            if peer is not None:
                peer.close()
        raise
    finally:
        selector.close()
        listener.setblocking(True)
    return [peer for peer in peers.values() if peer is not None]


def _accept_one(listener: socket.socket, selector: selectors.BaseSelector,
                pending: dict[socket.socket, tuple[bytearray, float]], hello_seconds: float) -> None:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return
    conn.setblocking(False)
    pending[conn] = (bytearray(), time.monotonic() + hello_seconds)
    selector.register(conn, selectors.EVENT_READ)


def _read_hello(sock: socket.socket, buffer: bytearray, *, epoch: str, peers: dict[int, socket.socket | None]
                ) -> Hello | None:
    """Read what ``sock`` has into ``buffer``; its ``Hello`` once complete, else None. ``WireError`` for a
    connection to drop (closed, oversized, malformed, another epoch, an unexpected rank)."""
    try:
        chunk = sock.recv(8192)
    except OSError as exc:
        raise WireError(str(exc)) from None
    if not chunk:
        raise WireError("closed before its hello")
    buffer += chunk
    if len(buffer) < 4:
        return None
    length = int.from_bytes(buffer[:4], "little")
    if length > 4096:
        raise WireError(f"announced a {length}-byte hello")
    if len(buffer) < 4 + length:
        return None
    hello = decode_hello(bytes(buffer[4:4 + length]), epoch=epoch)
    if hello.rank not in peers or peers[hello.rank] is not None:
        raise WireError(f"hello from unexpected rank {hello.rank}")
    return hello
