"""The bench's workers as the manager sees them: an ``ActorWorkerGroup`` over the actor ranks' pipes and one
``RolloutReplica`` of one worker per receiving process (of two, with ``--parts``), so that every engine entry is
``CheckpointEngineManager.update_weights()`` — its setup, ``auto``, staged flow, stripes and delta — exactly as a
deployment runs it. The bench only measures around it (the serving probe, the links' counters).

Each call is one JSON command on the worker's pipe (``weightsync.cli.bench.worker``), answered on a thread of a pool
sized to the workers, so the manager's event loop never blocks; a worker takes one command at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Sequence
from typing import Any

from weightsync.api.hooks import WholePauseHooks
from weightsync.api.types import StagedUpdate, TransferReport
from weightsync.cli.bench.worker import Channel

__all__ = ["PipeActorGroup", "PipeReplica", "PipeWorker", "Pipes"]


class Pipes:
    """Every worker's channel, and the threads their commands wait on."""

    def __init__(self, channels: Sequence[Channel], name: str) -> None:
        self.channels = list(channels)
        self.name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.channels)),
                                                           thread_name_prefix="bench-pipe")
        self._locks: dict[int, asyncio.Lock] = {}

    async def call(self, index: int, op: str, **fields: Any) -> Any:
        """Command ``op`` on worker ``index``; its reply."""
        lock = self._locks.setdefault(index, asyncio.Lock())
        async with lock:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._round_trip, index,
                                                                    {"op": op, **fields})

    def _round_trip(self, index: int, command: dict[str, Any]) -> Any:
        channel = self.channels[index]
        channel.send_bytes(json.dumps(command).encode())
        try:
            return json.loads(channel.recv_bytes())
        except EOFError:
            raise RuntimeError(f"{self.name}: worker {index} died during {command['op']} (see its traceback "
                               "above)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PipeActorGroup:
    """``ActorWorkerGroup`` over workers ``0..world_size-1`` of ``pipes`` (each sends its model)."""

    def __init__(self, pipes: Pipes, world_size: int) -> None:
        self._pipes = pipes
        self._size = world_size

    @property
    def world_size(self) -> int:
        return self._size

    def execute_checkpoint_engine(self, method: str, /, **per_rank: Sequence[Any]) -> list[Any]:
        return [self._pipes.call(rank, "execute", method=method,
                                 kwargs={key: values[rank] for key, values in per_rank.items()})
                for rank in range(self._size)]

    def update_weights(self, *, version: int) -> list[Any]:
        return [_report(self._pipes.call(rank, "send", version=version)) for rank in range(self._size)]


class PipeWorker:
    """``RolloutWorker`` (and ``StagingWorker``) over worker ``index`` of ``pipes``."""

    def __init__(self, pipes: Pipes, index: int, name: str) -> None:
        self._pipes, self._index, self._name = pipes, index, name

    @property
    def name(self) -> str:
        return self._name

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return self._pipes.call(self._index, "execute", method=method, kwargs=kwargs)

    def update_weights(self, *, version: int) -> Any:
        return _report(self._pipes.call(self._index, "receive", version=version))

    async def stage_weights(self, *, version: int) -> StagedUpdate:
        return StagedUpdate.from_dict(await self._pipes.call(self._index, "stage", version=version))

    async def apply_staged(self, *, version: int, staged: StagedUpdate) -> TransferReport:
        return TransferReport.from_dict(await self._pipes.call(self._index, "apply_staged", staged=staged.to_dict()))


class PipeReplica(WholePauseHooks):
    """``RolloutReplica`` (and ``PausableReplica``) of its workers (one, or two that each hold a part: ``--parts``).
    With ``serving`` its pause and resume stop and start the workers' serving loops, and record what the serving
    probe reads afterwards, worker by worker: the end of the last pass before each pause (``lasts``) and the pass
    count at each resume (``marks``)."""

    def __init__(self, workers: list[PipeWorker], pipes: Pipes, indices: list[int], *, serving: bool) -> None:
        self._workers, self._pipes, self._indices, self._serving = workers, pipes, indices, serving
        self.lasts: list[list[float]] = []
        self.marks: list[list[int]] = []

    @property
    def workers(self) -> list[PipeWorker]:
        return list(self._workers)

    async def pause(self) -> None:
        if self._serving:
            lasts = await asyncio.gather(*(self._pipes.call(index, "pause") for index in self._indices))
            self.lasts.append([float(last) for last in lasts])

    async def resume(self) -> None:
        if self._serving:
            marks = await asyncio.gather(*(self._pipes.call(index, "resume") for index in self._indices))
            self.marks.append([int(mark) for mark in marks])


async def _report(reply: Any) -> TransferReport:
    return TransferReport.from_dict(await reply)
