"""Elastic replicas, before an update: a replica whose worker process was killed between updates is found dead by
the manager's health check (Ray declares the actor dead: a ``WorkerDiedError``), evicted — named in the report, left
out of the membership — and every other replica commits that same update, a delta still, with no user call. Dead
replicas beyond ``SyncConfig.max_evicted`` (or all of them) fail the update before any replica is paused, evicting
none."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, kill_actor, running_cluster
from tests.workloads import NUDGED, TpSource, tp_tensors, weights_digest
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import WorkerDiedError
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager


@pytest.fixture
def cluster(ray_nodes: RayNodes) -> Iterator[Cluster]:
    with running_cluster(ray_nodes, TpSource, replicas=3) as made:
        yield made


def kill(cluster: Cluster, replica: int) -> None:
    """SIGKILL the replica's worker process, and wait (bounded) until Ray says its actor is dead."""
    kill_actor(lambda: cluster.replicas[replica].call("pid")[0], f"replica {replica}")


def update(manager: CheckpointEngineManager, version: int) -> tuple[str, UpdateReport]:
    return weights_digest(tp_tensors(version)), asyncio.run(manager.update_weights(version=version))


def test_a_replica_killed_between_updates_is_evicted_and_the_others_commit_a_delta(cluster: Cluster) -> None:
    manager = CheckpointEngineManager(
        backend="shm", actor_wg=cluster.actor_wg, replicas=list(cluster.replicas),
        config=SyncConfig(bucket_bytes=256 * 1024, delta=True, timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (NUDGED + 1, NUDGED + 2):
        ray.get(cluster.actor_wg.call("set_version", version))
        asyncio.run(manager.update_weights(version=version))
    kill(cluster, 1)
    ray.get(cluster.actor_wg.call("set_version", NUDGED + 3))
    expected, report = update(manager, NUDGED + 3)
    assert [(outcome.replica, outcome.state) for outcome in report.evicted] == [(1, "evicted")]
    assert "WorkerDiedError: replica1" in str(report.evicted[0].error)
    assert [outcome.state for outcome in report.replicas] == ["committed"] * 2
    assert [outcome.received for outcome in report.replicas] == ["changes"] * 2
    assert cluster.digests([0, 2]) == [expected] * 2
    assert manager.replicas == (cluster.replicas[0], cluster.replicas[2])
    # Every replica left dead: the update fails before any pause, evicting none (the negative control).
    for replica in (0, 2):
        kill(cluster, replica)
    before = [(state.state, state.version) for state in manager.status()]
    ray.get(cluster.actor_wg.call("set_version", NUDGED + 4))
    with pytest.raises(WorkerDiedError) as raised:
        asyncio.run(manager.update_weights(version=NUDGED + 4))
    assert "2 of 2 replicas are dead" in "\n".join(getattr(raised.value, "__notes__", []))
    assert len(manager.replicas) == 2 and [(state.state, state.version) for state in manager.status()] == before
