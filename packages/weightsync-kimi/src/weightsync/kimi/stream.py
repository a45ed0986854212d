"""``ReceivedWeights`` over checkpoint-engine's per-bucket IPC callback.

The callback (on checkpoint-engine's IPC thread) hands a bucket's ``(name, tensor)`` views to the event loop and
waits until the consumer asks for the item after the bucket's last one: the views stay valid exactly as long as the
Protocol promises, and checkpoint-engine reuses the buffer only after the callback returns.

The stream holds the engine (core's ``Handover``) through its consumer and its update thread: a consumer that
leaves early lets the remaining buckets through untaken, and the engine is free once the update thread is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from weightsync.api.errors import DigestMismatchError, TransferError
from weightsync.api.protocols import copy_stream_into
from weightsync.api.types import TransferReport
from weightsync.core.backend import EngineSettings
from weightsync.kimi.mapping import Exchange, SetDigest, Weights

__all__ = ["KimiStream", "StreamHold"]

_End = BaseException | None
"""What the update thread leaves in the queue when it is done: its error, or None."""


class StreamHold(Protocol):
    """What ``Handover.hold_for_stream()`` returns (core exports ``Handover`` but not the hold's class)."""

    finished: bool

    async def start(self) -> None: ...

    def release(self) -> None: ...


class KimiStream:
    """One update's stream on a rollout worker; ``update`` is the blocking part, run in ``pool``."""

    def __init__(self, settings: EngineSettings, *, hold: StreamHold, pool: concurrent.futures.Executor,
                 update: Callable[[KimiStream], object], peer: str) -> None:
        self.report: TransferReport | None = None
        self.expected: Exchange | None = None
        """The whole update's digest, size and version, from the exchange (set by the update thread)."""
        self._settings = settings
        self._hold = hold
        self._pool = pool
        self._update = update
        self._peer = peer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Weights | BaseException | None] | None = None
        self._bucket: Weights = []
        self._position = 0
        self._consumed: threading.Event | None = None
        self._consumed_next: threading.Event | None = None
        self._digest = SetDigest()
        self._tensors = 0
        self._buckets = 0
        self._started = time.perf_counter()
        self._finished = False
        self._closed = threading.Event()

    def __aiter__(self) -> KimiStream:
        return self

    # -- the update thread's side ------------------------------------------------------------------------------------

    def deliver(self, weights: Weights) -> None:
        """checkpoint-engine's ``run`` callback: one bucket, valid until this returns."""
        loop = self._loop
        if loop is None or self._closed.is_set():
            return
        if self._settings.verify_digest:
            for name, tensor in weights:
                self._digest.add(name, tensor)
        consumed = threading.Event()
        try:
            loop.call_soon_threadsafe(self._hand_over, list(weights), consumed)
        except RuntimeError:  # the consumer's loop is gone: nobody will take it
            return
        deadline = time.monotonic() + self._settings.timeout
        while not consumed.wait(0.05):
            if self._closed.is_set():
                return
            if time.monotonic() > deadline:
                raise TransferError("kimi: the consumer did not take a bucket in time", peer="local consumer")

    def _hand_over(self, weights: Weights, consumed: threading.Event) -> None:
        if self._queue is not None:
            self._consumed_next = consumed
            self._queue.put_nowait(weights)

    def fail(self, exc: BaseException) -> None:
        self._end(exc)

    def _end(self, end: _End) -> None:
        loop, queue = self._loop, self._queue
        if loop is not None and queue is not None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, end)
            except RuntimeError:  # the consumer's loop is gone
                pass

    def _run_update(self) -> None:
        """The update thread: the blocking part, then the end of the stream; then it lets go of the engine."""
        try:
            self._update(self)
        except BaseException as exc:
            self._end(exc)
        else:
            self._end(None)
        finally:
            self._hold.release()

    # -- the consumer's side -----------------------------------------------------------------------------------------

    async def _start(self) -> asyncio.Queue[Weights | BaseException | None]:
        if self._queue is None:
            await self._hold.start()  # counts the update thread as a holder (after a draining stream, if any)
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            try:
                self._pool.submit(self._run_update)
            except RuntimeError:  # the engine closed its pool: the thread will never release its hold
                self._hold.release()
                raise
        return self._queue

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Callable[[str, torch.Tensor], object] | None = None,
    ) -> int:
        """checkpoint-engine hands over its own views; nothing faster than copying each (see ``copy_stream_into``)."""
        return await copy_stream_into(self, destinations, fallback=fallback)

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if self._finished:
            raise StopAsyncIteration
        try:
            queue = await self._start()
            while True:
                if self._position < len(self._bucket):
                    item = self._bucket[self._position]
                    self._position += 1
                    self._tensors += 1
                    return item
                if self._consumed is not None:  # past the bucket's last item: checkpoint-engine may reuse it
                    self._consumed.set()
                    self._consumed = None
                arrived = await queue.get()
                if isinstance(arrived, BaseException):
                    raise arrived
                if arrived is None:
                    self._complete()
                    raise StopAsyncIteration
                self._bucket, self._position = arrived, 0
                self._consumed = self._consumed_next
                self._buckets += 1
        except BaseException:
            self._close()
            raise

    def _complete(self) -> None:
        settings, rank = self._settings, self._settings.context.rank
        try:
            expected = self.expected
            if expected is None:
                raise TransferError("kimi: the update ended before the digest exchange", peer=self._peer)
            actual = self._digest.hexdigest()
            if settings.verify_digest and expected.digest != actual:
                raise DigestMismatchError(
                    f"rollout rank {rank} received tensors whose digest {actual[:16]} differs from the actor ranks' "
                    f"{expected.digest[:16]}: the update was corrupted in transit",
                    receiver=rank, expected=expected.digest, actual=actual,
                )
            self.report = TransferReport(
                role="rollout", rank=rank, version=expected.version, nbytes=expected.nbytes,
                tensors=self._tensors, buckets=self._buckets, seconds=time.perf_counter() - self._started,
                digest=actual if settings.verify_digest else expected.digest, sender=0,
            )
        finally:
            self._close()

    async def aclose(self) -> None:
        """The consumer leaves early: checkpoint-engine's remaining buckets are let through untaken."""
        self._close()

    def _close(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._closed.set()
        if self._consumed is not None:
            self._consumed.set()
        self._hold.finished = True
        self._hold.release()
