"""Staged updates (``SyncConfig(staged=True)``) with Ray replicas on two Ray nodes: stage while serving, pause only
to swap.

Everything is checked from outside the engine: what each worker holds (its own tensors' bytes hashed by the worker),
the pause/resume hooks each replica's sink saw (its own log), the staging areas in ``/dev/shm`` and in each worker's
``/proc/self/maps``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray

from tests.conftest import RayNodes
from tests.workloads import DeltaModelSource, StagedSink
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import ConfigError, LoadVerificationError, WeightsyncError
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica, RayRolloutWorker

BUCKET = 256 * 1024
PAUSE = ["abort_all_requests", "release_kv_cache"]
RESUME = ["resume_kv_cache", "resume_generation"]


@dataclass
class StagedWorld:
    actor_wg: RayActorWorkerGroup
    replicas: list[RayRolloutReplica]

    def manager(self, *, delta: bool, backend: str = "gloo") -> CheckpointEngineManager:
        return CheckpointEngineManager(
            backend=backend, actor_wg=self.actor_wg, replicas=self.replicas,
            config=SyncConfig(bucket_bytes=BUCKET, staged=True, delta=delta,
                              timeouts=StepTimeouts(transfer=30, setup=30)))

    def version(self, version: int) -> str:
        return str(ray.get(self.actor_wg.call("set_version", version)[0]))

    def digests(self) -> list[list[str]]:
        """Per replica, what each of its workers holds."""
        return [list(ray.get(replica.call("digest"))) for replica in self.replicas]

    def hooks(self) -> list[list[str]]:
        """Per replica, the hooks its first worker's sink saw (every worker of a replica sees the same ones)."""
        return [list(ray.get(replica.call("hook_log")[0])) for replica in self.replicas]

    def worker_call(self, replica: int, worker: int, method: str) -> Any:
        return ray.get(self.replicas[replica].workers[worker].call(method))

    def update(self, manager: CheckpointEngineManager, version: int) -> UpdateReport:
        expected = self.version(version)
        report = asyncio.run(manager.update_weights(version=version))
        assert report.ok, report.replicas
        assert self.digests() == [[expected] * len(replica.workers) for replica in self.replicas], version
        return report


@pytest.fixture
def world(ray_nodes: RayNodes) -> Iterator[StagedWorld]:
    """Three replicas over two Ray nodes (two hosts to the manager): replica0's two workers on the head, replica1
    spanning both nodes, replica2 on the other node. Each node's first worker in replica order stages for it."""
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=DeltaModelSource, node_id=ray_nodes.head)
    replicas = [
        RayRolloutReplica.create(replica=0, sink_factory=StagedSink, num_workers=2, node_id=ray_nodes.head),
        RayRolloutReplica.create(replica=1, sink_factory=StagedSink, num_workers=2,
                                 node_id=[ray_nodes.head, ray_nodes.other]),
        RayRolloutReplica.create(replica=2, sink_factory=StagedSink, node_id=ray_nodes.other),
    ]
    try:
        yield StagedWorld(actor_wg, replicas)
    finally:
        actor_wg.shutdown()
        for replica in replicas:
            replica.shutdown()


def staging_files(world: StagedWorld) -> dict[str, int]:
    """The ``/dev/shm`` files made by the rollout workers' processes (gloo makes none: these are staging areas),
    with their sizes."""
    pids = {int(ray.get(ref)) for replica in world.replicas for ref in replica.call("pid")}
    found = {}
    for name in os.listdir("/dev/shm"):
        parts = name.split("-")
        if name.startswith("weightsync-") and len(parts) > 2 and parts[1].isdigit() and int(parts[1]) in pids:
            found[name] = os.stat(os.path.join("/dev/shm", name)).st_size
    return found


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_ten_staged_updates_are_bit_exact_with_one_staging_area_per_host(world: StagedWorld, delta: bool) -> None:
    manager = world.manager(delta=delta)
    first = world.update(manager, 1)
    areas = staging_files(world)
    assert len(areas) == 2, areas  # one per host, not one per worker (five workers)
    for version in range(2, 11):
        report = world.update(manager, version)
        if delta:
            assert [outcome.received for outcome in report.replicas] == ["changes"] * 3, version
        assert staging_files(world) == areas, version  # the same areas, the same sizes: reused, not grown
    # Every worker maps exactly its own host's area: the head's three workers one, the other node's two the other.
    mapped = [world.worker_call(r, w, "mapped_areas") for r, w in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]]
    assert all(len(paths) == 1 for paths in mapped), mapped
    assert mapped[0] == mapped[1] == mapped[2] and mapped[3] == mapped[4] and mapped[0] != mapped[3], mapped
    assert {os.path.basename(paths[0]) for paths in mapped} == set(areas)
    # Each update paused each replica exactly once, for its swap.
    assert world.hooks() == [(PAUSE + RESUME) * 10] * 3
    for outcome in [*first.replicas, *report.replicas]:
        assert outcome.state == "committed" and outcome.resumed
        assert outcome.stage_seconds > 0 and outcome.swap_seconds > 0 and outcome.pause_seconds >= outcome.swap_seconds
    assert [state.pause_seconds for state in manager.status()] == [o.pause_seconds for o in report.replicas]


def test_a_sender_failing_mid_stage_never_pauses_a_replica(world: StagedWorld) -> None:
    manager = world.manager(delta=False)
    world.update(manager, 1)
    held = world.digests()
    ray.get(world.actor_wg.call("set_mode", "raise_midway"))
    world.version(2)
    with pytest.raises(WeightsyncError):
        asyncio.run(manager.update_weights(version=2))
    # Nobody was paused: every replica still serves version 1, whole.
    assert world.hooks() == [PAUSE + RESUME] * 3
    assert world.digests() == held
    assert [(state.state, state.version, state.resumed, state.pause_seconds) for state in manager.status()] == [
        ("committed", 1, True, 0.0)] * 3
    ray.get(world.actor_wg.call("set_mode", "normal"))
    world.update(manager, 3)
    assert world.hooks() == [(PAUSE + RESUME) * 2] * 3


def test_a_failed_swap_leaves_its_replica_torn_and_paused_until_the_next_update(world: StagedWorld) -> None:
    manager = world.manager(delta=True)
    world.update(manager, 1)
    world.worker_call(1, 1, "fail_next")  # replica1's worker on the other node fails part-way through its apply
    expected = world.version(2)
    with pytest.raises(WeightsyncError, match="part-way"):
        asyncio.run(manager.update_weights(version=2))
    states = manager.status()
    assert [(state.state, state.resumed) for state in states] == [("committed", True), ("torn", False),
                                                                  ("committed", True)]
    hooks = world.hooks()
    assert hooks[0] == hooks[2] == (PAUSE + RESUME) * 2
    assert hooks[1] == PAUSE + RESUME + PAUSE  # paused for its swap, and left paused
    assert world.digests()[0] == [expected] * 2 and world.digests()[2] == [expected]
    report = world.update(manager, 3)  # repaired: every replica full (a torn replica holds no base)
    assert [outcome.received for outcome in report.replicas] == ["full"] * 3
    assert [(state.state, state.resumed) for state in manager.status()] == [("committed", True)] * 3


class _Proving(RayRolloutReplica):
    """A replica with a proof of load (``LoadProvingReplica``): what its first worker holds, asked while paused;
    ``lie`` makes it claim another value."""

    lie = False

    async def weight_checksums(self) -> dict[str, str]:
        held = await self.call("digest")[0]
        return {"model": "another value" if self.lie else str(held)}


def test_a_replica_whose_proof_of_load_disagrees_is_paused_again_and_torn(world: StagedWorld) -> None:
    replicas = [_Proving(replica.workers) for replica in world.replicas]
    manager = CheckpointEngineManager(backend="gloo", actor_wg=world.actor_wg, replicas=replicas,
                                      config=SyncConfig(bucket_bytes=BUCKET, staged=True))
    world.update(manager, 1)  # control: every replica's checksums agree
    replicas[2].lie = True
    world.version(2)
    with pytest.raises(LoadVerificationError, match="replica2"):
        asyncio.run(manager.update_weights(version=2))
    assert [(state.state, state.resumed) for state in manager.status()] == [
        ("committed", True), ("committed", True), ("torn", False)]
    hooks = world.hooks()
    assert hooks[0] == hooks[1] == (PAUSE + RESUME) * 2
    assert hooks[2] == (PAUSE + RESUME) * 2 + PAUSE  # its swap resumed it; the comparison paused it again
    replicas[2].lie = False
    world.update(manager, 3)
    assert [(state.state, state.resumed) for state in manager.status()] == [("committed", True)] * 3


def test_workers_that_cannot_stage_are_a_config_error_before_any_pause(world: StagedWorld) -> None:
    # The same actor behind a plain RayRolloutWorker: an actor without stage_weights / apply_staged.
    replica = RayRolloutReplica([RayRolloutWorker(worker.handle, name=worker.name)
                                 for worker in world.replicas[2].workers])
    manager = CheckpointEngineManager(backend="gloo", actor_wg=world.actor_wg, replicas=[world.replicas[0], replica],
                                      config=SyncConfig(bucket_bytes=BUCKET, staged=True))
    world.version(1)
    with pytest.raises(ConfigError, match="replica1/worker0 is a RayRolloutWorker, which cannot stage"):
        asyncio.run(manager.update_weights(version=1))
    assert world.hooks()[0] == [] and world.hooks()[2] == []
