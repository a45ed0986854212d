"""A drop-in for verl's ``CheckpointEngineManager``, built on ``weightsync.core``'s manager.

Select it in verl's config with
``actor_rollout_ref.rollout.checkpoint_manager_class=weightsync.verl.CheckpointEngineManager`` and a weightsync
backend (``checkpoint_engine.backend=weightsync.shm``, ``checkpoint_engine.custom_backend_module=weightsync.verl``).

What it accepts is what verl 0.9.1 calls: ``CheckpointEngineManager(config=..., actor_wg=..., replicas=...)``,
``update_weights(self.global_steps)`` from the synchronous PPO trainers, ``await update_weights(global_steps=...)``
from the fully-async trainer, the replica methods (``sleep_replicas``, ``abort_replicas(reject_request=...)``,
``resume_generation_replicas``, ...), ``add_replicas``/``remove_replicas`` and edits of the ``replicas`` list.

What it does differently from verl's: it never blocks its event loop (it awaits Ray ObjectRefs; no ``ray.get``),
each step has a timeout (``engine_kwargs.timeouts``), the topology is built once per membership (not every update),
receivers' digests are checked against the sender's, and the replicas are resumed in ``finally`` when an update
fails — see :attr:`CheckpointEngineManager.torn_replicas` for those the failure may have half-written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConfigError, reject_renamed_keywords
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager as _CoreManager
from weightsync.core.control.steps import gather
from weightsync.verl.config import read_checkpoint_config
from weightsync.verl.engine import REGISTRY_PREFIX, sync_config_from_engine_kwargs
from weightsync.verl.groups import VerlActorWorkerGroup, VerlRolloutReplica

__all__ = ["CheckpointEngineManager", "ResumingCheckpointEngineManager", "sync_or_awaitable"]

T = TypeVar("T")


def sync_or_awaitable(coroutine: Coroutine[Any, Any, T]) -> T | Coroutine[Any, Any, T]:
    """verl's calling convention (its ``@auto_await``): run to completion when no event loop is running, else hand
    the coroutine back for the caller to await. Unlike verl's, it never runs the coroutine on a helper thread
    while a loop is running: that would block the loop for the whole update."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    return coroutine


class CheckpointEngineManager:
    """verl's manager interface over weightsync's (non-blocking, timed, resuming) manager.

    ``config`` is verl's ``CheckpointEngineConfig`` (or the same as a mapping); its ``backend`` must be a weightsync
    backend registered by ``weightsync.verl`` (``weightsync.<name>``). ``actor_wg`` is verl's actor
    ``RayWorkerGroup``; ``replicas`` verl's ``RolloutReplica`` objects (kept as the public list ``replicas``, which
    verl's code may edit directly; the next update picks the change up and rebuilds the topology).
    """

    torn_replicas: ClassVar[Literal["hold", "resume"]] = "hold"
    """What a failed update does with replicas it may have half-written (every other replica is resumed).

    ``"hold"``: their KV cache is resumed and their request gate switched to *reject*
    (``abort_all_requests(reject_request=True)``): they serve nothing from a half-written model and park no
    request forever; the next successful update repairs and resumes them. ``"resume"``
    (:class:`ResumingCheckpointEngineManager`): they are resumed like the others, as verl callers that crash or
    retry at once may prefer.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> CheckpointEngineManager:
        # Before Python's own keyword check, so `trainer=` gets a message naming `actor_wg=` and the codemod.
        reject_renamed_keywords(cls.__name__, kwargs)
        return super().__new__(cls)

    def __init__(self, *, config: Any, actor_wg: Any, replicas: Sequence[Any]) -> None:
        checkpoint = read_checkpoint_config(config)
        backend = checkpoint.backend
        if not backend.startswith(REGISTRY_PREFIX):
            raise ConfigError(
                f"weightsync.verl.CheckpointEngineManager moves weights with weightsync backends "
                f"({REGISTRY_PREFIX}<name>, e.g. {REGISTRY_PREFIX}shm); checkpoint_engine.backend is {backend!r}. "
                "Use verl's own CheckpointEngineManager for verl's backends (naive, nccl, ...)"
            )
        # verl imports custom_backend_module in the driver as well; a user's plugin module may register more.
        checkpoint.import_modules()
        self.config = config
        self.backend = backend
        self.sync_config: SyncConfig = sync_config_from_engine_kwargs(
            bucket_bytes=checkpoint.bucket_bytes, engine_kwargs=checkpoint.engine_kwargs
        )
        self.actor_wg = actor_wg
        self._actor = actor_wg if isinstance(actor_wg, VerlActorWorkerGroup) else VerlActorWorkerGroup(actor_wg)
        self._actor.mode = backend
        self.replicas: list[Any] = list(replicas)
        self._wrapped: list[tuple[Any, VerlRolloutReplica]] = []
        for replica in self.replicas:
            self._wrapper(replica)  # fails now, naming missing methods, not in the first update
        self._core = _CoreManager(
            backend=backend.removeprefix(REGISTRY_PREFIX), actor_wg=self._actor, replicas=[], config=self.sync_config
        )
        self.last_report: UpdateReport | None = None

    # -- membership (verl's semantics: edit the list; the next update rebuilds) -----------------------------------

    def add_replicas(self, replicas: list[Any]) -> None:
        self.replicas.extend(replicas)

    def remove_replicas(self, replicas: list[Any]) -> None:
        self.replicas = [known for known in self.replicas if not any(known is gone for gone in replicas)]

    def _wrapper(self, replica: Any) -> VerlRolloutReplica:
        for known, wrapper in self._wrapped:
            if known is replica:
                return wrapper
        wrapper = VerlRolloutReplica(replica)
        self._wrapped.append((replica, wrapper))
        return wrapper

    def _reconcile(self) -> list[VerlRolloutReplica]:
        """Bring the core manager's replicas in line with ``self.replicas`` (which verl code may have edited)."""
        wanted = [self._wrapper(replica) for replica in self.replicas]
        current = list(self._core.replicas)
        gone = [wrapper for wrapper in current if not any(wrapper is w for w in wanted)]
        if gone:
            self._core.remove_replicas(gone)
        new = [wrapper for wrapper in wanted if not any(wrapper is w for w in current)]
        if new:
            self._core.add_replicas(new)
        self._wrapped = [(replica, wrapper) for replica, wrapper in self._wrapped
                         if any(wrapper is w for w in wanted)]
        return wanted

    def _wrappers(self) -> list[tuple[str, VerlRolloutReplica]]:
        return [(f"replica{index}", self._wrapper(replica)) for index, replica in enumerate(self.replicas)]

    # -- the update ----------------------------------------------------------------------------------------------

    def update_weights(self, global_steps: int | None = None) -> Any:
        """verl's call: ``update_weights(self.global_steps)`` (runs to completion when no event loop is running)
        or ``await update_weights(global_steps=...)``. Returns verl's metrics dict. Typed code:
        ``update_weights_async``."""
        return sync_or_awaitable(self.update_weights_async(global_steps))

    async def update_weights_async(self, global_steps: int | None = None) -> dict[str, float]:
        if global_steps is not None and (isinstance(global_steps, bool) or not isinstance(global_steps, int)):
            raise ConfigError(f"global_steps must be an int, got {global_steps!r}")
        wrappers = self._reconcile()
        if not wrappers:
            raise ConfigError("update_weights with no rollout replicas")
        # The core manager counts its own versions (verl repeats a step, e.g. around validation); verl's step goes
        # to the workers as the label it has always been.
        self._actor.global_steps = global_steps
        for wrapper in wrappers:
            wrapper.global_steps = global_steps
        try:
            report = await self._core.update_weights()
        except BaseException as failure:
            await self._settle_torn(failure)
            raise
        self.last_report = report
        return report.metrics()

    async def _settle_torn(self, failure: BaseException) -> None:
        """After a failed update the core manager has resumed every intact replica; deal with the others."""
        states = {status.replica: status.state for status in self._core.status()}
        torn = [wrapper for index, wrapper in enumerate(self._core.replicas)
                if states.get(index) == "torn" and isinstance(wrapper, VerlRolloutReplica)]
        if not torn:
            return
        timeouts = self.sync_config.timeouts
        labels = [f"replica{index}" for index, state in sorted(states.items()) if state == "torn"]
        try:
            await gather("resume", timeouts.resume, [(label, r.resume_kv_cache()) for label, r in zip(labels, torn)])
            if self.torn_replicas == "resume":
                await gather("resume", timeouts.resume,
                             [(label, r.resume_generation()) for label, r in zip(labels, torn)])
            else:
                await gather("pause", timeouts.pause, [
                    (label, r.abort_all_requests(reject_request=True)) for label, r in zip(labels, torn)
                ])
        except Exception as exc:  # the update's own error is the one to report
            failure.add_note(f"settling the torn replicas {', '.join(labels)} failed too: {exc!r}")

    # -- replica control (verl's names; each runs to completion or returns an awaitable, like update_weights) --------

    def sleep_replicas(self) -> Any:
        """Sleep all rollout replicas (free weights and KV cache)."""
        return sync_or_awaitable(self._replica_step("pause", "sleep"))

    def wake_up_replicas(self) -> Any:
        return sync_or_awaitable(self._replica_step("resume", "wake_up"))

    def abort_replicas(self, reject_request: bool = False) -> Any:
        """Abort in-flight requests; ``reject_request`` fails new ones instead of parking them (verl's meaning)."""
        return sync_or_awaitable(self._replica_step("pause", "abort_all_requests", reject_request=reject_request))

    def resume_generation_replicas(self) -> Any:
        return sync_or_awaitable(self._replica_step("resume", "resume_generation"))

    def release_kv_cache_replicas(self) -> Any:
        return sync_or_awaitable(self._replica_step("pause", "release_kv_cache"))

    def resume_kv_cache_replicas(self) -> Any:
        return sync_or_awaitable(self._replica_step("resume", "resume_kv_cache"))

    async def _replica_step(self, step: Literal["pause", "resume"], hook: str, **kwargs: Any) -> None:
        timeout = self.sync_config.timeouts.pause if step == "pause" else self.sync_config.timeouts.resume
        await gather(hook, timeout, [(label, getattr(wrapper, hook)(**kwargs)) for label, wrapper in self._wrappers()])


class ResumingCheckpointEngineManager(CheckpointEngineManager):
    """As :class:`CheckpointEngineManager`, but a failed update resumes every replica, half-written ones included."""

    torn_replicas: ClassVar[Literal["hold", "resume"]] = "resume"

