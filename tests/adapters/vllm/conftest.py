"""One Ray cluster, two vLLM replicas with weightsync and one plain reference engine, started once for the module
(an engine takes about a minute to start here): the tests share them and leave them serving."""

from __future__ import annotations

import asyncio
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# vLLM is imported inside the fixture: without it (the main test env) this file must still import, and the test
# modules skip themselves.

# Each engine's OpenMP threads on a core of their own where there are enough (two engines on one core by accident
# make both slow); on this 2-core machine the two replicas take one core each and the reference shares core 0.
_CORES = os.cpu_count() or 1


def _bind(index: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": str(index % _CORES)}


@dataclass
class Serving:
    actor_wg: Any
    """A ``RayActorWorkerGroup`` of two ``LlamaTrainer`` ranks."""
    replicas: list[Any]
    """Two ``VllmRolloutReplica`` with weightsync as their weight-transfer engine."""
    reference: Any
    """A plain vLLM engine (no weightsync) that loads each version from its checkpoint."""
    checkpoints: pathlib.Path
    loop: asyncio.AbstractEventLoop

    def run(self, awaitable: Any) -> Any:
        return self.loop.run_until_complete(awaitable)


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    import ray

    from tests.adapters.vllm.workloads import LlamaTrainer, build_model, write_checkpoint
    from weightsync.ray import RayActorWorkerGroup
    from weightsync.vllm import VllmRolloutReplica, engine_args

    root = tmp_path_factory.mktemp("vllm")
    start = write_checkpoint(root / "v0", {n: p.detach().bfloat16() for n, p in build_model().named_parameters()})
    ray.init(num_cpus=8, logging_level="ERROR", include_dashboard=False)
    loop = asyncio.new_event_loop()
    made: list[Any] = []
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=LlamaTrainer)
    try:
        async def start_all() -> list[Any]:
            return list(await asyncio.gather(*[
                VllmRolloutReplica.create(replica=i, args=engine_args(str(start)), weightsync=i < 2, env=_bind(i))
                for i in range(3)
            ]))

        made = loop.run_until_complete(start_all())
        yield Serving(actor_wg=actor_wg, replicas=made[:2], reference=made[2], checkpoints=root, loop=loop)
    finally:
        for replica in made:
            try:
                loop.run_until_complete(replica.stop())
            except Exception:  # noqa: BLE001 - keep stopping the others
                pass
        actor_wg.shutdown()
        loop.close()
        ray.shutdown()
