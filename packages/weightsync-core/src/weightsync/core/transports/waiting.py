"""Waiting with a deadline, written once: polling a completion, a free receive slot, peers' acknowledgements.

Every blocking wait in weightsync has an absolute deadline (``time.monotonic()`` seconds) and raises
``TransferError`` naming the peer when it passes; none spins a core (polls sleep with exponential back-off).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

from weightsync.api.errors import TransferError, WireError
from weightsync.core.wire import codec
from weightsync.core.wire.framing import recv_frame, send_frame

__all__ = ["poll_until", "poll_until_async", "FreeSlots", "AckedPeers", "SlotSequence"]


def poll_until(done: Callable[[], bool], *, deadline: float, peer: str, what: str, first: float = 50e-6,
               most: float = 5e-3) -> None:
    """Poll ``done()`` with sleeps growing from ``first`` to ``most`` until true; ``TransferError`` at ``deadline``.

    For completions that can only be polled (a transfer library's request, a device event): a blocking wait could
    not be given a deadline, and a peer that never answers would freeze the thread.
    """
    pause = first
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"timed out {what} {peer}", peer=peer)
        time.sleep(min(pause, left))
        pause = min(pause * 2, most)


async def poll_until_async(done: Callable[[], bool], *, deadline: float, on_timeout: Callable[[], BaseException]
                           ) -> None:
    """``poll_until`` for an event loop: awaits between polls (1 ms growing to 50 ms), so the loop keeps running."""
    pause = 0.001
    while not done():
        if time.monotonic() > deadline:
            raise on_timeout()
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.05)


class FreeSlots:
    """A receiver's ring slots that the consumer has released: the receive thread takes one before each bucket."""

    def __init__(self, slots: int) -> None:
        self._free = list(range(slots))
        self._cond = threading.Condition()

    def take(self, deadline: float) -> int:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=max(deadline - time.monotonic(), 0)):
                raise TransferError("timed out waiting for the consumer to release a receive buffer",
                                    peer="local consumer")
            return self._free.pop(0)

    def give(self, slot: int) -> None:
        with self._cond:
            if slot not in self._free:
                self._free.append(slot)
                self._cond.notify()


class SlotSequence:
    """Which published bucket (1-based, counted per epoch) each ring slot last carried."""

    def __init__(self, slots: int) -> None:
        self.published = 0
        self._last = [0] * slots

    def last(self, slot: int) -> int:
        return self._last[slot]

    def publish(self, slot: int) -> int:
        self.published += 1
        self._last[slot] = self.published
        return self.published

    def record(self, slot: int, seq: int) -> None:
        self._last[slot] = seq


class AckedPeers:
    """Peers that acknowledge, in order, each bucket they are done with (``codec.Ack`` frames on a socket).

    A slot may be overwritten once every peer acknowledged the bucket it last carried: ``wait(seq)``. A peer whose
    connection closes (its process died: ``TransferError.closed``) is dropped, not waited for: the others go on,
    and the lost one — with whatever reads from it — fails on its own, which the manager reports. ``lost`` names
    the dropped peers and why.
    """

    def __init__(self, peers: list[tuple[str, socket.socket]], epoch: str) -> None:
        self.peers = peers
        self.epoch = epoch
        self._acked = [0] * len(peers)
        self.lost: dict[str, str] = {}

    def wait(self, seq: int, deadline: float) -> None:
        for index, (name, sock) in enumerate(self.peers):
            while name not in self.lost and self._acked[index] < seq:
                try:
                    frame = recv_frame(sock, deadline=deadline, peer=name, max_len=4096)
                except TransferError as exc:
                    self._drop_if_closed(name, exc)
                    break
                ack = codec.decode_ack(frame, epoch=self.epoch)
                if ack.index != self._acked[index] + 1:
                    raise WireError(f"{name} acknowledged bucket {ack.index} after {self._acked[index]}")
                self._acked[index] = ack.index

    def send_all(self, frame: bytes, deadline: float) -> None:
        """Send ``frame`` to every peer not lost."""
        for name, sock in self.peers:
            if name in self.lost:
                continue
            try:
                send_frame(sock, frame, deadline=deadline, peer=name)
            except TransferError as exc:
                self._drop_if_closed(name, exc)

    def _drop_if_closed(self, name: str, error: TransferError) -> None:
        if not error.closed:
            raise error
        self.lost[name] = str(error)

    def close(self) -> None:
        for _, sock in self.peers:
            sock.close()
