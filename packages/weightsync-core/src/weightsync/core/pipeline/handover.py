"""Who holds an engine: one update at a time, and the hand-over from a draining receive stream to the next one.

An engine runs one update at a time. A sender holds it for the whole of ``send_weights``. A receive stream holds
it until both its consumer (``async for`` / ``copy_into``, or ``aclose``) and its receive thread are done: when the
consumer leaves early, the receive thread still receives and drops the rest of the update (so the sender and the
other receivers can finish it), and a ``receive_weights`` called meanwhile gets a stream that takes the engine over
once that drain ends, without blocking the caller's event loop.
"""

from __future__ import annotations

import threading
import time

from weightsync.api.errors import ConcurrentUpdateError
from weightsync.core.transports.waiting import poll_until_async

__all__ = ["Handover", "Hold"]


class Hold:
    """One receive stream's claim on the engine: counted holders (its consumer and its receive thread)."""

    __slots__ = ("handover", "count", "finished")

    def __init__(self, handover: Handover, *, owns: bool) -> None:
        self.handover = handover
        self.count = 1 if owns else 0
        self.finished = False
        """The consumer left (normally or early)."""

    async def start(self) -> None:
        """As the stream starts receiving: take the engine over if it was born while another drained, then count
        the receive thread (and the consumer, when taken over) as holders."""
        took_over = self.count == 0
        if took_over:
            await self.handover.take_over(self)
        with self.handover.claim:
            self.count += 2 if took_over else 1

    def release(self) -> None:
        """One holder is done; the last one releases the engine."""
        self.handover.drop(self)


class Handover:
    """Owns the engine's busy lock and the draining/successor bookkeeping; nothing else touches them."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        self.busy = threading.Lock()
        self.claim = threading.Lock()
        """Guards the hand-over of ``busy`` from a draining stream to the next one, and every ``Hold.count``."""
        self.draining: Hold | None = None
        """A stream whose consumer left early while its receive thread still drops the rest of its update."""
        self.successor: Hold | None = None
        """The stream waiting for ``draining`` to finish before it starts."""

    def acquire_for(self, what: str) -> None:
        """Hold the engine for a whole step that is not a receive stream (``send_weights``, ``stage_weights``)."""
        if not self.busy.acquire(blocking=False):
            raise ConcurrentUpdateError(f"{self.name}: {what} while another update is in flight")

    def release(self) -> None:
        """The step ``acquire_for`` held the engine for is over."""
        self.busy.release()

    def hold_for_stream(self) -> Hold:
        """A new receive stream's hold: the engine now, or once the draining stream is done."""
        with self.claim:
            if self.busy.acquire(blocking=False):
                return Hold(self, owns=True)
            if self.draining is None or self.successor is not None:
                raise ConcurrentUpdateError(f"{self.name}: receive_weights while another update is in flight")
            self.successor = Hold(self, owns=False)
            return self.successor

    async def take_over(self, hold: Hold) -> None:
        limit = self.timeout + 5.0

        def timed_out() -> BaseException:
            return ConcurrentUpdateError(f"{self.name}: the previous update, left early by its consumer, was still "
                                         f"being received {limit:g} s later")

        try:
            await poll_until_async(lambda: self.busy.acquire(blocking=False), deadline=time.monotonic() + limit,
                                   on_timeout=timed_out)
        finally:
            with self.claim:
                if self.successor is hold:
                    self.successor = None

    def drop(self, hold: Hold) -> None:
        with self.claim:
            if hold.count == 0:  # closed before it took the engine over
                if self.successor is hold:
                    self.successor = None
                return
            hold.count -= 1
            if hold.count == 0:
                if self.draining is hold:
                    self.draining = None
                self.busy.release()
            elif hold.finished:  # the consumer left; the receive thread still drops the rest of the update
                self.draining = hold

    def wait_idle(self, wait: float) -> None:
        """Until the update in flight (if any) released the engine; ``ConcurrentUpdateError`` after ``wait`` s."""
        if not self.busy.acquire(timeout=wait):
            raise ConcurrentUpdateError(f"{self.name}: an abandoned update did not stop within {wait:g} s")
        self.busy.release()

    @property
    def in_flight(self) -> bool:
        return self.busy.locked()
