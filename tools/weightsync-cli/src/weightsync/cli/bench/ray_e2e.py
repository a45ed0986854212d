"""``weightsync bench``'s Ray end-to-end figure: one ``update_weights`` of a 1 MiB model against a no-op call.

The target: end-to-end ``update_weights`` for a 1 MiB model through the Ray adapter, pause → resume included, takes at
most 5 × the time of one no-op call gathered from every worker, measured in the same run.

Everything is built as a user builds it: a local Ray cluster (or the one this process already joined), a
``RayActorWorkerGroup`` whose ranks hold a ``BenchSource``, ``RayRolloutReplica``s of one worker each holding a
``BenchSink`` (an inference model that copies every tensor into its preallocated parameters and implements the pause
hooks), and a ``CheckpointEngineManager``. The no-op is ``ping`` on every actor rank's source and every rollout
worker's sink through the adapter's own ``call`` path, all sent at once and awaited together. Updates and no-ops
are timed alternately (after a warm-up of each, the first update building the topology), so both see the same load
on this shared machine; the figures are medians.
"""

from __future__ import annotations

import asyncio
import functools
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from weightsync.api.config import MiB, SyncConfig
from weightsync.api.protocols import load_into

__all__ = ["E2E_LAYOUT", "E2E_TARGET", "BenchSink", "BenchSource", "RayEndToEnd", "measure_ray_end_to_end",
           "ray_unavailable"]

E2E_TARGET = 5.0
"""The bar: an update may take at most this many times one no-op call gathered from every worker."""

E2E_LAYOUT: list[tuple[str, tuple[int, ...]]] = [
    ("model.embed_tokens.weight", (128, 1024)),
    ("model.layers.0.self_attn.qkv_proj.weight", (64, 1024)),
    ("model.layers.0.mlp.up_proj.weight", (128, 1024)),
    ("model.layers.0.mlp.down_proj.weight", (64, 1024)),
    ("lm_head.weight", (128, 1024)),
]
"""bf16 tensors adding up to exactly 1 MiB."""


def _tensors(layout: list[tuple[str, tuple[int, ...]]], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in layout}


class BenchSource:
    """An actor rank's model (the ``WeightSource``): every rank yields the whole model, as a gathered FSDP model."""

    def __init__(self, rank: int, world_size: int, *, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.weights = _tensors(layout, seed=0)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()

    async def ping(self) -> None:
        """The no-op the update is measured against."""


class BenchSink:
    """A rollout worker's inference model (the ``WeightSink``): copies each tensor into its own parameters."""

    def __init__(self, replica: int, worker: int, *, layout: list[tuple[str, tuple[int, ...]]]) -> None:
        torch.set_num_threads(1)
        self.parameters = _tensors(layout, seed=1 + replica)
        self.version = 0
        self.serving = True

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        await load_into(weights, self.parameters)
        self.version = version

    async def abort_all_requests(self) -> None:
        self.serving = False

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass

    async def resume_generation(self) -> None:
        self.serving = True

    async def ping(self) -> None:
        """The no-op the update is measured against."""

    def state(self) -> tuple[int, bool]:
        return self.version, self.serving


@dataclass(frozen=True)
class RayEndToEnd:
    backend: str
    model_bytes: int
    bucket_bytes: int
    workers: int
    """Every worker the no-op reaches: the actor ranks plus every rollout worker."""
    update_seconds: list[float]
    noop_seconds: list[float]
    stage_seconds: dict[str, list[float]] = field(default_factory=dict)
    """Per manager step (pause, transfer, finalize, resume), each timed update's seconds."""

    @property
    def update_p50(self) -> float:
        return statistics.median(self.update_seconds)

    @property
    def noop_p50(self) -> float:
        return statistics.median(self.noop_seconds)

    @property
    def ratio(self) -> float:
        """Rounded as the JSON reports it, so that the printed line, the JSON and ``meets`` agree to the digit."""
        return round(self.update_p50 / self.noop_p50, 3)

    @property
    def meets(self) -> bool:
        return self.ratio <= E2E_TARGET

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "model_bytes": self.model_bytes, "bucket_bytes": self.bucket_bytes,
            "workers": self.workers, "repeat": len(self.update_seconds),
            "update_ms_p50": round(self.update_p50 * 1e3, 3), "noop_ms_p50": round(self.noop_p50 * 1e3, 3),
            "ratio": self.ratio, "target_ratio": E2E_TARGET, "meets": self.meets,
            "stages_ms_p50": {step: round(statistics.median(seconds) * 1e3, 3)
                              for step, seconds in self.stage_seconds.items()},
        }


def ray_unavailable() -> str | None:
    """Why the Ray measurement cannot run in this environment, or None when it can."""
    try:
        import ray  # noqa: F401
        import weightsync.ray  # noqa: F401
    except ImportError as exc:
        return f"{exc} (pip install weightsync-ray)"
    return None


def measure_ray_end_to_end(*, backend: str, workers: int = 2, replicas: int = 2, repeat: int = 20,
                           warmup: int = 3, bucket_bytes: int = MiB,
                           step: Callable[[str], None] | None = None) -> RayEndToEnd:
    """Time ``repeat`` updates and ``repeat`` gathered no-ops, alternately, after ``warmup`` of each.

    ``workers`` actor ranks and ``replicas`` one-worker replicas; ``step(label)`` is called after each warm-up and
    each timed pair (a progress bar's hook). Starts a local Ray cluster unless this process already joined one, and
    shuts down only what it started.
    """
    import ray

    started_ray = False
    if not ray.is_initialized():
        # "local": a cluster of our own even when another one runs on this machine. Actors reserve no CPU.
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        started_ray = True
    try:
        return asyncio.run(_measure(backend=backend, world_size=workers, replicas=replicas, repeat=repeat,
                                    warmup=warmup, bucket_bytes=bucket_bytes, step=step or (lambda label: None)))
    finally:
        if started_ray:
            ray.shutdown()


async def _measure(*, backend: str, world_size: int, replicas: int, repeat: int, warmup: int, bucket_bytes: int,
                   step: Callable[[str], None]) -> RayEndToEnd:
    import ray
    from weightsync.core.control.manager import CheckpointEngineManager
    from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

    layout = E2E_LAYOUT
    # Every actor on this process's node: on a joined multi-node cluster, a same-host backend (shm) still applies.
    node_id = str(ray.get_runtime_context().get_node_id())
    actor_wg = RayActorWorkerGroup.create(world_size=world_size, node_id=node_id,
                                          source_factory=functools.partial(BenchSource, layout=layout))
    rollout: list[RayRolloutReplica] = []
    try:
        rollout = [RayRolloutReplica.create(replica=index, node_id=node_id,
                                            sink_factory=functools.partial(BenchSink, layout=layout))
                   for index in range(replicas)]
        manager = CheckpointEngineManager(backend=backend, actor_wg=actor_wg, replicas=rollout,
                                          config=SyncConfig(bucket_bytes=bucket_bytes))

        async def noop() -> float:
            begun = time.perf_counter()
            refs = [*actor_wg.call("ping"), *(ref for replica in rollout for ref in replica.call("ping"))]
            await asyncio.gather(*refs)
            return time.perf_counter() - begun

        version = 0

        async def update() -> tuple[float, dict[str, float]]:
            nonlocal version
            version += 1
            begun = time.perf_counter()
            report = await manager.update_weights(version=version)
            elapsed = time.perf_counter() - begun
            if not report.ok or not all(outcome.resumed for outcome in report.replicas):
                raise RuntimeError(f"ray end-to-end: update {version} did not commit and resume every replica: "
                                   f"{report.replicas}")
            return elapsed, dict(report.stages)

        for index in range(warmup):
            await noop()
            await update()  # the first one builds the topology (prepare, init_process_group)
            step(f"ray e2e: warm-up {index + 1}/{warmup}")
        update_seconds: list[float] = []
        noop_seconds: list[float] = []
        stage_seconds: dict[str, list[float]] = {}
        for index in range(repeat):
            noop_seconds.append(await noop())
            elapsed, stages = await update()
            update_seconds.append(elapsed)
            for name, seconds in stages.items():
                stage_seconds.setdefault(name, []).append(seconds)
            step(f"ray e2e: {index + 1}/{repeat}")
        states = await asyncio.gather(*(ref for replica in rollout for ref in replica.call("state")))
        if any(tuple(state) != (version, True) for state in states):
            raise RuntimeError(f"ray end-to-end: replicas ended in states {states}, expected version {version}, "
                               "serving")
        total = sum(2 * math.prod(shape) for _, shape in layout)
        return RayEndToEnd(backend=backend, model_bytes=total, bucket_bytes=bucket_bytes,
                           workers=world_size + sum(len(replica.workers) for replica in rollout),
                           update_seconds=update_seconds, noop_seconds=noop_seconds, stage_seconds=stage_seconds)
    finally:
        for replica in rollout:
            replica.shutdown()
        actor_wg.shutdown()
