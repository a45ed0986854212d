"""One Ray cluster, two vLLM replicas with weightsync and one plain reference engine, started once for the session
(an engine takes about a minute to start here): the tests share them and leave them serving. The tensor-parallel
module (``test_vllm_workers.py``, the last to run) stops them (:meth:`Serving.stop`) before it starts its own
engines of two workers each: the two sets are never alive together on this machine's two cores."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import Iterator, Mapping
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

    start: pathlib.Path
    """The checkpoint every engine starts from."""
    stopped: bool = False

    def run(self, awaitable: Any) -> Any:
        if self.stopped:
            raise RuntimeError("the session's TP-1 engines were stopped by the tensor-parallel module, which runs last")
        return self.loop.run_until_complete(awaitable)

    def start_engines(self, count: int, *, weightsync: int, env: Mapping[str, str] | None = None,
                      **overrides: Any) -> list[Any]:
        """``count`` engines from ``start`` (the first ``weightsync`` with weightsync), ``overrides`` in their
        ``AsyncEngineArgs``, ``env`` in their processes' environment."""
        from weightsync.cli.vllm.serving import bind_env  # on this 2-core machine engines share the cores
        from weightsync.vllm import VllmRolloutReplica, engine_args


        async def start_all() -> list[Any]:
            return list(await asyncio.gather(*[
                VllmRolloutReplica.create(replica=i, args=engine_args(str(self.start), **overrides),
                                          weightsync=i < weightsync,
                                          env={**bind_env(i, overrides.get("tensor_parallel_size", 1)),
                                               **(env or {})})
                for i in range(count)
            ]))

        return list(self.loop.run_until_complete(start_all()))

    def stop_engines(self, engines: list[Any]) -> None:
        for replica in engines:
            try:
                self.loop.run_until_complete(replica.stop())
            except Exception:  # noqa: BLE001 - keep stopping the others
                pass

    def stop(self) -> None:
        """Stop the session's engines (the replicas and the reference); the actor worker group and Ray stay."""
        if not self.stopped:
            self.stop_engines([*self.replicas, self.reference])
            self.stopped = True


@pytest.fixture(scope="session")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    import ray

    from tests.adapters.vllm.workloads import FaultyTrainer
    from weightsync.cli.vllm.workload import SMALL, build_model, write_checkpoint
    from weightsync.ray import RayActorWorkerGroup

    root = tmp_path_factory.mktemp("vllm")
    start = write_checkpoint(root / "v0", {n: p.detach().bfloat16() for n, p in build_model(SMALL).named_parameters()},
                             SMALL)
    ray.init(num_cpus=8, logging_level="ERROR", include_dashboard=False)
    loop = asyncio.new_event_loop()
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=FaultyTrainer,
                                          node_id=ray.get_runtime_context().get_node_id())
    serving = Serving(actor_wg=actor_wg, replicas=[], reference=None, checkpoints=root, loop=loop, start=start)
    try:
        made = serving.start_engines(3, weightsync=2)
        serving.replicas, serving.reference = made[:2], made[2]
        yield serving
    finally:
        serving.stop()
        actor_wg.shutdown()
        loop.close()
        ray.shutdown()
