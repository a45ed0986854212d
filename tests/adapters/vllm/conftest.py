"""One Ray cluster, two vLLM replicas with weightsync and one plain reference engine, started once for the session
(an engine takes about a minute to start here): the tests share them and leave them serving."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# vLLM is imported inside the fixture: without it (the main test env) this file must still import, and the test
# modules skip themselves.


@dataclass
class Serving:
    actor_wg: Any
    """A ``RayActorWorkerGroup`` of two ``FaultyTrainer`` ranks."""
    replicas: list[Any]
    """Two ``VllmRolloutReplica`` with weightsync as their weight-transfer engine."""
    reference: Any
    """A plain vLLM engine (no weightsync) that loads each version from its checkpoint."""
    checkpoints: pathlib.Path
    loop: asyncio.AbstractEventLoop

    def run(self, awaitable: Any) -> Any:
        return self.loop.run_until_complete(awaitable)


@pytest.fixture(scope="session")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    import ray

    from tests.adapters.vllm.workloads import FaultyTrainer
    from weightsync.cli.vllm.serving import bind_env  # on this 2-core machine the reference shares core 0
    from weightsync.cli.vllm.workload import SMALL, build_model, write_checkpoint
    from weightsync.ray import RayActorWorkerGroup
    from weightsync.vllm import VllmRolloutReplica, engine_args

    root = tmp_path_factory.mktemp("vllm")
    start = write_checkpoint(root / "v0", {n: p.detach().bfloat16() for n, p in build_model(SMALL).named_parameters()},
                             SMALL)
    ray.init(num_cpus=8, logging_level="ERROR", include_dashboard=False)
    loop = asyncio.new_event_loop()
    made: list[Any] = []
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=FaultyTrainer)
    try:
        async def start_all() -> list[Any]:
            return list(await asyncio.gather(*[
                VllmRolloutReplica.create(replica=i, args=engine_args(str(start)), weightsync=i < 2, env=bind_env(i))
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
