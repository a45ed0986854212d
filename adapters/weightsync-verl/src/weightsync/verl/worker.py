"""``WeightsyncActorMixin``: the two worker methods verl's managers call on the actor worker group.

verl's own actor workers (``verl.workers.engine_workers.ActorRolloutRefWorker``) define them; a user's worker class
(any ``verl.single_controller.base.Worker``) gets them from this mixin and supplies only ``named_weights()``::

    class MyActor(WeightsyncActorMixin, Worker):
        def __init__(self, config):
            super().__init__()
            self.model = ...
            self.init_checkpoint_engine(config)   # verl's CheckpointEngineConfig

        def named_weights(self):
            return self.model.state_dict().items()

Both methods are registered with verl's decorator and the dispatch modes verl's ``CheckpointEngineManager`` (and
ours) expect: ``execute_checkpoint_engine`` with ``DP_COMPUTE`` (entry i of each list argument goes to rank i),
``update_weights`` with ``ONE_TO_ALL``; both non-blocking (the group returns one Ray ObjectRef per rank).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.single_controller.base.decorator import Dispatch, register

from weightsync.api.errors import ConfigError, LifecycleError
from weightsync.api.sources import SOURCE_KEY
from weightsync.verl.config import read_checkpoint_config
from weightsync.verl.sources import Exported, layout_of, shards_of

__all__ = ["WeightsyncActorMixin"]

F = TypeVar("F", bound=Callable[..., Any])

# The engine's lifecycle steps that are plain functions and may block (a rendezvous waits for peers).
_BLOCKING_STEPS = frozenset({"prepare", "init_process_group", "finalize", "close", "abort", "transfer_report"})


def _registered(dispatch_mode: Any, *, blocking: bool) -> Callable[[F], F]:
    """verl's ``register`` with a type: it returns the function it wraps, with its signature kept (``wraps``)."""
    decorator: Callable[[F], F] = register(dispatch_mode=dispatch_mode, blocking=blocking)
    return decorator


class WeightsyncActorMixin:
    """Checkpoint-engine methods for a verl actor worker; the class using it provides ``named_weights()``."""

    checkpoint_engine: Any = None
    checkpoint_backend: str = ""

    def init_checkpoint_engine(self, config: Any, *, is_master: bool | None = None) -> None:
        """Build this rank's checkpoint engine from verl's ``CheckpointEngineConfig``, as verl's actor workers do:
        import ``custom_backend_module`` (where ``weightsync.verl`` registers its backends), then
        ``CheckpointEngineRegistry.new(backend, is_master=..., bucket_size=..., **engine_kwargs[backend])``.
        ``is_master`` defaults to "this is rank 0" (verl's ``Worker.rank``)."""
        checkpoint = read_checkpoint_config(config)
        checkpoint.import_modules()
        if is_master is None:
            is_master = int(getattr(self, "rank", 0)) == 0
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            checkpoint.backend, is_master=is_master, bucket_size=checkpoint.bucket_bytes, **checkpoint.engine_kwargs
        )
        self.checkpoint_backend = checkpoint.backend

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's current model as ``(name, tensor)`` pairs (every rank is drained; see send_weights)."""
        raise NotImplementedError(f"{type(self).__name__} must define named_weights() to use WeightsyncActorMixin")

    def weight_shards(self) -> Exported | None:
        """This rank's shards as verl's engines export them — ``(name, local_shard, ShardSpec)``, e.g.
        ``self.engine.get_per_tensor_param_shard()[0]`` — to send them as they are, never gathered
        (:mod:`weightsync.verl.sources`); None (the default): send ``named_weights()``. Its layout is declared at
        every ``prepare``, so the driver checks before any pause that every byte a rollout worker needs is held."""
        return None

    def _engine(self) -> Any:
        if self.checkpoint_engine is None:
            raise LifecycleError(f"{type(self).__name__}: call init_checkpoint_engine(config) before syncing weights")
        return self.checkpoint_engine

    @_registered(Dispatch.DP_COMPUTE, blocking=False)
    async def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one engine method. Blocking steps run on a thread: this actor's event loop keeps serving calls
        (verl's own workers run them on the loop, which stalls the actor while peers rendezvous)."""
        function = getattr(self._engine(), method)
        if method in _BLOCKING_STEPS:
            result = await asyncio.to_thread(function, *args, **kwargs)
            shards = self.weight_shards() if method == "prepare" else None
            if shards is not None:  # a sharded actor_wg: what this rank holds, for the plan
                result = {**result, SOURCE_KEY: layout_of(shards).to_dict()}
            return result
        result = function(*args, **kwargs)
        return await result if asyncio.iscoroutine(result) else result

    @_registered(Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        """Send this rank's weights through its checkpoint engine; returns the engine's metrics (verl's contract).

        ``mode`` is what verl's manager passes (its backend name). ``"naive"`` (colocated actor and rollout in one
        process) needs a rollout engine in this worker, which this mixin does not host.
        """
        effective = self.checkpoint_backend if mode == "auto" else mode
        if effective == "naive":
            raise ConfigError("WeightsyncActorMixin serves disaggregated rollouts; the naive (colocated) mode "
                              "needs verl's hybrid ActorRolloutRefWorker")
        shards = self.weight_shards()
        weights = shards_of(shards) if shards is not None else self.named_weights()
        metrics = await self._engine().send_weights(weights, global_steps=global_steps)
        return dict(metrics or {})
