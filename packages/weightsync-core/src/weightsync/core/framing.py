"""Length-prefixed frames on a stream socket, with deadlines: the control channel of socket-based transports.

A frame is a 4-byte little-endian length followed by that many bytes (at most ``MAX_FRAME``). Every read and write
takes an absolute deadline (``time.monotonic()``) and raises ``TransferError`` naming the peer when it passes or
when the peer goes away; a blocked call sleeps in the kernel, it never spins.
"""

from __future__ import annotations

import socket
import time

from weightsync.api.errors import TransferError, WireError

__all__ = ["MAX_FRAME", "send_frame", "recv_frame"]

MAX_FRAME = 64 << 20


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
        raise TransferError(f"connection to {peer} failed while sending: {exc}", peer=peer) from None


def _recv_exact(sock: socket.socket, size: int, *, deadline: float, peer: str) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        try:
            sock.settimeout(_remaining(deadline, peer, "waiting for"))
            chunk = sock.recv(size - len(chunks))
        except socket.timeout:
            raise TransferError(f"timed out waiting for {peer}", peer=peer) from None
        except OSError as exc:
            raise TransferError(f"connection to {peer} failed while receiving: {exc}", peer=peer) from None
        if not chunk:
            raise TransferError(f"{peer} closed the connection", peer=peer)
        chunks += chunk
    return bytes(chunks)


def recv_frame(sock: socket.socket, *, deadline: float, peer: str, max_len: int = MAX_FRAME) -> bytes:
    length = int.from_bytes(_recv_exact(sock, 4, deadline=deadline, peer=peer), "little")
    if length > max_len:
        raise WireError(f"{peer} announced a {length}-byte frame (limit {max_len})")
    return _recv_exact(sock, length, deadline=deadline, peer=peer)
