"""One verl world for this directory's tests: verl's own workers on CPU, in the session's Ray cluster.

- the actor side: a ``RayWorkerGroup`` of two ``ToyActorWorker`` ranks (``WeightsyncActorMixin`` + verl ``Worker``);
- the rollout side: two replicas of verl's own ``CheckpointEngineWorker`` (two workers, then one), each with a
  ``RecordingServerAdapter``; both sides build their checkpoint engine from the same verl config, through
  ``custom_backend_module=weightsync.verl`` and verl's ``CheckpointEngineRegistry``.

Starting these processes (each imports verl) is the slow part, so the world is built once per session. verl is
imported inside the fixture: without verl this file must still import (the test modules skip themselves).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.conftest import RayNodes

BACKEND = "weightsync.shm"


@dataclass
class VerlWorld:
    config: Any
    """verl's ``CheckpointEngineConfig`` every worker was built from (and the managers get)."""
    actor_wg: Any
    replicas: list[Any]
    """``ToyReplica`` objects (verl ``RolloutReplica`` stand-ins) over ``CheckpointEngineWorker`` actors."""
    groups: list[Any] = field(default_factory=list)

    def set_model(self, version: int, delay: float = 0.0) -> None:
        self.actor_wg.set_model(version, delay)  # verl's blocking ONE_TO_ALL call: returns when every rank has it

    def received(self) -> list[Any]:
        """Per rollout worker (replica by replica): its server adapter's last received tensors and update kwargs."""
        import ray

        from tests.adapters.verl.workloads import snapshot

        return list(ray.get([worker.__ray_call__.remote(snapshot) for replica in self.replicas
                             for worker in replica.workers]))

    def fail_next_update(self, *, replica: int, worker: int, after: int) -> None:
        import ray

        from tests.adapters.verl.workloads import fail_next_update

        ray.get(self.replicas[replica].workers[worker].__ray_call__.remote(fail_next_update, after))

    def clear_hooks(self) -> None:
        for replica in self.replicas:
            replica.hooks.clear()


@pytest.fixture(scope="session")
def verl_world(ray_nodes: RayNodes) -> Iterator[VerlWorld]:
    yield from build_world(BACKEND)


@pytest.fixture(scope="module")
def verl_auto_world(ray_nodes: RayNodes) -> Iterator[VerlWorld]:
    """A smaller world with ``weightsync.auto`` (the session's Ray cluster has room for both): one actor rank, one
    replica of one worker; engines are built at prepare, for the backend weightsync's manager picks."""
    yield from build_world("weightsync.auto", actor_ranks=1, replica_workers=(1,))


@pytest.fixture(scope="module")
def verl_sharded_world(ray_nodes: RayNodes) -> Iterator[VerlWorld]:
    """Two actor ranks of an FSDP2-sharded model exporting their shards as verl's engines do
    (``ShardedToyActor``), one replica of one worker, ``weightsync.shm``."""
    yield from build_world("weightsync.shm", actor_ranks=2, replica_workers=(1,), actor="ShardedToyActor")


def build_world(backend: str, *, actor_ranks: int = 2, replica_workers: tuple[int, ...] = (2, 1),
                actor: str = "ToyActorWorker") -> Iterator[VerlWorld]:
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineWorker
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    from tests.adapters.verl import workloads
    from tests.adapters.verl.workloads import BUCKET_MEGABYTES, RecordingServerAdapter, ToyReplica

    config = CheckpointEngineConfig(
        backend=backend,
        update_weights_bucket_megabytes=BUCKET_MEGABYTES,
        custom_backend_module="weightsync.verl",
        # A transfer that stalls fails within a minute instead of weightsync's default ten.
        engine_kwargs={backend: {"timeouts": {"setup": 60, "transfer": 60}}},
    )

    pools: list[Any] = []

    def pool(processes: int) -> Any:
        # One CPU per process (verl's default bundle reserves 10).
        pools.append(RayResourcePool(process_on_nodes=[processes], use_gpu=False, max_colocate_count=1))
        return pools[-1]

    actor_wg = RayWorkerGroup(
        resource_pool=pool(actor_ranks), ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(getattr(workloads, actor)),
                                                                      checkpoint_config=config),
        device_name="cpu",
    )
    groups, replicas = [], []
    for replica_rank, workers in enumerate(replica_workers):
        rollout_config = RolloutConfig(name="weightsync-test", checkpoint_engine=config)
        group = RayWorkerGroup(
            resource_pool=pool(workers),
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(CheckpointEngineWorker), rollout_config=rollout_config, model_config=None,
                server_adapter=RecordingServerAdapter(replica_rank),
            ),
            device_name="cpu",
        )
        groups.append(group)
        replicas.append(ToyReplica(replica_rank, group.workers))
    world = VerlWorld(config=config, actor_wg=actor_wg, replicas=replicas, groups=[actor_wg, *groups])
    try:
        yield world
    finally:
        for group in world.groups:
            for handle in group.workers:
                ray.kill(handle)
        # A pool's placement groups outlive its actors and keep their CPUs reserved: a later world's pool would wait
        # for them forever (verl waits for a placement group with no deadline).
        for made in pools:
            for group in made.pgs or []:
                ray.util.remove_placement_group(group)
