"""What the vLLM demo and bench share: a local Ray cluster with an actor worker group of Llama trainers and vLLM
replicas started from the trainers' first checkpoint, each engine's CPU threads on a core of its own."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import pathlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from weightsync.cli.demo import free_port
from weightsync.cli.vllm.workload import LlamaTrainer

__all__ = ["Serving", "serving"]


@dataclass(kw_only=True)
class Serving:
    actor_wg: Any
    """A ``RayActorWorkerGroup`` of two :class:`LlamaTrainer` ranks, joined (gradients all-reduced over gloo)."""
    replicas: list[Any]
    """``VllmRolloutReplica``: weightsync ones, then the plain ones (``plain=``)."""
    start: pathlib.Path
    """The checkpoint every engine started from (version 0)."""


def bind_env(index: int, tensor_parallel_size: int = 1) -> dict[str, str]:
    """Engine ``index``'s OpenMP threads: each of its workers on a core of its own, engines taking the next cores in
    turn (two workers sharing a core by accident make both slow); vLLM's form, ``"0|1"`` for two workers."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        str((index * tensor_parallel_size + worker) % cores) for worker in range(tensor_parallel_size))}


@contextlib.asynccontextmanager
async def serving(*, config: dict[str, Any], root: pathlib.Path, replicas: int, plain: int = 0,
                  address: str | None = None, tensor_parallel_size: int = 1, whole: int = 0
                  ) -> AsyncIterator[Serving]:
    """Start everything (Ray included) and stop it all on the way out; ``plain`` engines without weightsync. Every
    engine runs ``tensor_parallel_size`` workers; of several, the last ``whole`` weightsync replicas' workers each
    receive the whole model (``VllmRolloutReplica.create(parts=False)``), the others' only their parts."""
    import ray

    from weightsync.ray import RayActorWorkerGroup
    from weightsync.vllm import VllmRolloutReplica, engine_args

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # "local" starts a cluster of our own even when another one runs on this machine; every engine is an actor.
    # vLLM's own logs stay in the actors' log files (errors reach the driver as exceptions).
    ray.init(address=address or "local", num_cpus=None if address else max(8, replicas + plain + 4),
             include_dashboard=False, logging_level="ERROR", log_to_driver=False, ignore_reinit_error=True)
    actor_wg: Any = None
    made: list[Any] = []
    try:
        actor_wg = RayActorWorkerGroup.create(  # on this machine unless a cluster is given: the ranks start together
            world_size=2, source_factory=functools.partial(LlamaTrainer, config=config),
            node_id=None if address else ray.get_runtime_context().get_node_id())
        host = await actor_wg.call("address")[0]
        await asyncio.gather(*actor_wg.call("join", f"tcp://{host}:{free_port()}"))
        start = pathlib.Path(await actor_wg.handles[0].call.remote("save", str(root / "v0")))
        args = engine_args(str(start), kv_cache_memory_bytes=128 << 20, tensor_parallel_size=tensor_parallel_size)
        results = await asyncio.gather(*[
            VllmRolloutReplica.create(replica=index, args=args, weightsync=index < replicas,
                                      env=bind_env(index, tensor_parallel_size),
                                      parts=index < replicas - whole)  # moot for a plain engine
            for index in range(replicas + plain)
        ], return_exceptions=True)
        made = [result for result in results if not isinstance(result, BaseException)]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield Serving(actor_wg=actor_wg, replicas=made, start=start)
    finally:
        for replica in made:
            with contextlib.suppress(Exception):
                await replica.stop()
        if actor_wg is not None:
            actor_wg.shutdown()
        ray.shutdown()
