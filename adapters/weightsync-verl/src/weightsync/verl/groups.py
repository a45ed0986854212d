"""Typed views of verl's worker group and rollout replicas: weightsync's ``ActorWorkerGroup`` / ``RolloutReplica``.

verl attaches a worker group's methods at runtime (``RayWorkerGroup`` binds every ``@register``-ed method of the
worker class), so mypy sees nothing and a missing method surfaces as an ``AttributeError`` deep inside an update.
These wrappers check at construction that what the manager needs is bound, name what is missing, and expose it
with types. Every call returns Ray ``ObjectRef``s or coroutines awaiting them: nothing here calls ``ray.get``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.api.errors import ConfigError
from weightsync.api.types import TransferReport
from weightsync.verl.engine import report_from_dict

__all__ = ["VerlActorWorkerGroup", "VerlRolloutReplica", "VerlRolloutWorker", "ACTOR_METHODS", "REPLICA_METHODS"]

ACTOR_METHODS = ("execute_checkpoint_engine", "update_weights")
"""Methods verl's manager calls on the actor worker group (``WeightsyncActorMixin`` provides both)."""
REPLICA_METHODS = ("abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation", "sleep", "wake_up")
"""Coroutine methods of verl's ``RolloutReplica`` that the managers call."""

# How long a failed receiver gets to drop its engine, releasing the sender (best effort, see _update).
_ABORT_SECONDS = 10.0


def _missing(target: object, names: Sequence[str]) -> list[str]:
    return [name for name in names if not callable(getattr(target, name, None))]


class VerlActorWorkerGroup:
    """weightsync's ``ActorWorkerGroup`` over a verl ``RayWorkerGroup`` whose workers host a verl checkpoint engine.

    ``mode`` is passed to the workers' ``update_weights(global_steps=..., mode=...)`` as verl's manager does (the
    checkpoint backend's name, or ``"auto"``). ``global_steps`` is the trainer step the next update is labelled
    with; when ``None``, the manager's version is used.
    """

    def __init__(self, actor_wg: Any, /) -> None:
        missing = _missing(actor_wg, ACTOR_METHODS)
        if missing:
            raise ConfigError(
                f"the actor worker group {type(actor_wg).__name__} has no bound {', '.join(missing)}: its worker "
                "class must define them with verl's @register (inherit weightsync.verl.WeightsyncActorMixin, or use "
                "verl's ActorRolloutRefWorker)"
            )
        world_size = getattr(actor_wg, "world_size", None)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"actor worker group world_size must be a positive int, got {world_size!r}")
        workers = getattr(actor_wg, "workers", None)
        if not isinstance(workers, Sequence) or len(workers) != world_size:
            raise ConfigError("the actor worker group must expose its Ray actor handles as .workers, one per rank")
        self.wrapped = actor_wg
        self.mode = "auto"
        self.global_steps: int | None = None

    @property
    def world_size(self) -> int:
        return int(self.wrapped.world_size)

    def execute_checkpoint_engine(self, method: str, /, **per_rank_kwargs: Sequence[Any]) -> list[Any]:
        size = self.world_size
        for key, values in per_rank_kwargs.items():
            if len(values) != size:
                raise ConfigError(f"{key} has {len(values)} entries for {size} actor ranks")
        # verl's DP_COMPUTE dispatch hands entry i of every list argument to rank i; blocking=False returns refs.
        refs = self.wrapped.execute_checkpoint_engine(
            [method] * size, **{key: list(values) for key, values in per_rank_kwargs.items()}
        )
        return list(refs)

    def update_weights(self, *, version: int) -> list[Awaitable[TransferReport]]:
        global_steps = version if self.global_steps is None else self.global_steps
        refs = list(self.wrapped.update_weights(global_steps=global_steps, mode=self.mode))
        if len(refs) != self.world_size:
            raise ConfigError(f"update_weights returned {len(refs)} results for {self.world_size} actor ranks")
        return [self._report(rank, ref) for rank, ref in enumerate(refs)]

    async def _report(self, rank: int, update: Any) -> TransferReport:
        await update  # the rank's metrics dict, for verl's manager; ours wants the report behind it
        handle = self.wrapped.workers[rank]
        return report_from_dict(await handle.execute_checkpoint_engine.remote("transfer_report"))


class VerlRolloutWorker:
    """weightsync's ``RolloutWorker`` over one verl ``CheckpointEngineWorker`` actor of a replica."""

    def __init__(self, handle: Any, *, name: str, replica: VerlRolloutReplica) -> None:
        self.handle = handle
        self._name = name
        self._replica = replica

    @property
    def name(self) -> str:
        return self._name

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return self.handle.execute_checkpoint_engine.remote(method, **kwargs)

    def update_weights(self, *, version: int) -> Awaitable[TransferReport]:
        global_steps = version if self._replica.global_steps is None else self._replica.global_steps
        return self._update(global_steps)

    async def _update(self, global_steps: int) -> TransferReport:
        try:
            await self.handle.update_weights.remote(global_steps=global_steps)
        except BaseException:
            # This worker stopped consuming: dropping its engine closes its connections, so the sender fails now,
            # naming this peer, instead of waiting for its acknowledgements until the deadline.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._abort(), _ABORT_SECONDS)
            raise
        return report_from_dict(await self.handle.execute_checkpoint_engine.remote("transfer_report"))

    async def _abort(self) -> None:
        await self.handle.execute_checkpoint_engine.remote("abort")


class VerlRolloutReplica:
    """weightsync's ``RolloutReplica`` over a verl ``RolloutReplica`` (its ``.workers`` are checkpoint-engine
    workers; its hooks are coroutines). ``global_steps`` labels the next update, as on ``VerlActorWorkerGroup``."""

    def __init__(self, replica: Any, /) -> None:
        missing = _missing(replica, REPLICA_METHODS)
        if not hasattr(replica, "workers"):
            missing.insert(0, "workers")
        if missing:
            raise ConfigError(f"the rollout replica {type(replica).__name__} lacks {', '.join(missing)}")
        self.wrapped = replica
        self.global_steps: int | None = None

    @property
    def workers(self) -> list[VerlRolloutWorker]:
        # Read at each access: verl fills a replica's workers when it is initialised, possibly after construction.
        return [VerlRolloutWorker(handle, name=f"worker{index}", replica=self)
                for index, handle in enumerate(self.wrapped.workers)]

    async def abort_all_requests(self, *, reject_request: bool = False) -> None:
        await self.wrapped.abort_all_requests(reject_request=reject_request)

    async def release_kv_cache(self) -> None:
        await self.wrapped.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self.wrapped.resume_kv_cache()

    async def resume_generation(self) -> None:
        await self.wrapped.resume_generation()

    async def sleep(self) -> None:
        await self.wrapped.sleep()

    async def wake_up(self) -> None:
        await self.wrapped.wake_up()
