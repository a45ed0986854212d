"""Join and catch-up, on one host (``weightsync.core.control.join``): a replica added to a running manager with
delta updates catches up from a peer — a committed replica's worker serving the copy its receiver keeps — before
the next update, and that update is a delta for every replica, the newcomer included."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, running_cluster
from tests.workloads import ModelSource
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import ConfigError
from weightsync.core.control.manager import CheckpointEngineManager


@pytest.fixture
def cluster(ray_nodes: RayNodes) -> Iterator[Cluster]:
    with running_cluster(ray_nodes, ModelSource, replicas=2) as made:
        yield made


def test_a_replica_added_after_three_updates_catches_up_from_a_peer_and_the_next_update_is_a_delta(
        cluster: Cluster) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=True,
                                                        timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (1, 2, 3):
        cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    newcomer = cluster.add()
    manager.add_replicas([newcomer])
    expected = cluster.version(4)
    report = asyncio.run(manager.update_weights(version=4))
    assert [(outcome.replica, outcome.state, outcome.version) for outcome in report.joined] == [(2, "committed", 3)]
    assert "catch_up" in report.stages, report.stages
    assert [outcome.state for outcome in report.replicas] == ["committed"] * 3 and report.ok
    assert [outcome.received for outcome in report.replicas] == ["changes"] * 3, report.replicas
    assert cluster.digests([0, 1, 2]) == [expected] * 3


def test_a_catch_up_that_fails_leaves_the_newcomer_torn_and_unresumed_and_the_update_sends_everyone_the_model(
        cluster: Cluster) -> None:
    """The peer's copy checked against a model digest that is not the version's (the manager's record of it,
    replaced here: as if the peer held other bytes): the catch-up fails before the newcomer is resumed, it is named
    torn in ``joined``, and the update then sends every replica the full model, which repairs it."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=True,
                                                        timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (1, 2):
        cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    newcomer = cluster.add()
    manager.add_replicas([newcomer])
    manager._model = "0" * 32  # noqa: SLF001 - the fault: the version's model digest, as the peer must match it
    expected = cluster.version(3)
    report = asyncio.run(manager.update_weights(version=3))
    [joined] = report.joined
    assert (joined.replica, joined.state, joined.resumed) == (2, "torn", False), joined
    assert "DigestMismatchError" in str(joined.error) and "(peer)" in str(joined.error), joined.error
    assert "resume_generation" not in cluster.hooks(2)[:-2]  # resumed only by the update that repaired it
    assert report.ok and [outcome.received for outcome in report.replicas] == ["full"] * 3
    assert cluster.digests([0, 1, 2]) == [expected] * 3


def test_without_delta_a_joining_replica_is_told_to_take_the_full_update(cluster: Cluster,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024))
    asyncio.run(manager.update_weights())
    with caplog.at_level("WARNING", logger="weightsync.core.control.manager"):
        manager.add_replicas([cluster.add()])
    assert "catch-up from a peer needs SyncConfig(delta=True)" in caplog.text
    expected = cluster.version(5)
    report = asyncio.run(manager.update_weights())
    assert report.joined == () and report.ok and cluster.digests([0, 1, 2]) == [expected] * 3


def test_a_restarted_replica_replaces_the_old_one_and_catches_up(cluster: Cluster) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=True))
    for version in (1, 2):
        cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    old, restarted = cluster.replicas[1], cluster.add()
    manager.replace_replica(old, restarted)
    with pytest.raises(ConfigError):
        manager.replace_replica(cluster.replicas[0], restarted)  # already a member: refused before any change
    assert manager.replicas == (cluster.replicas[0], restarted)
    expected = cluster.version(3)
    report = asyncio.run(manager.update_weights(version=3))
    assert [(outcome.replica, outcome.state) for outcome in report.joined] == [(1, "committed")]
    assert [outcome.received for outcome in report.replicas] == ["changes"] * 2
    assert cluster.digests([0, 2]) == [expected] * 2


def test_the_ray_adapters_workers_are_peers_and_a_worker_whose_actor_cannot_serve_is_not() -> None:
    """``RayRolloutReplica.create``'s workers serve a joining replica (``PeerWorker``); the staging worker class
    (over any actor with ``stage_weights``) does not claim to, so the manager never picks one as a peer."""
    from weightsync.api.peers import PeerWorker
    from weightsync.ray import RayHostWorker, RayStagingWorker

    assert isinstance(RayHostWorker(None, name="worker0"), PeerWorker)
    assert not isinstance(RayStagingWorker(None, name="worker0"), PeerWorker)
