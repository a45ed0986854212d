"""Join and catch-up, on one host (``weightsync.core.control.join``): a replica added to a running manager with
delta or staged updates catches up from a peer — a committed replica's worker serving the copy its receiver keeps,
or its host's staging area — before the next update, and a delta update is then a delta for every replica, the
newcomer included."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, running_cluster
from tests.workloads import ModelSource
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import ConfigError, WeightsyncError
from weightsync.core.control.manager import CheckpointEngineManager


@pytest.fixture
def cluster(ray_nodes: RayNodes) -> Iterator[Cluster]:
    with running_cluster(ray_nodes, ModelSource, replicas=2) as made:
        yield made


@pytest.mark.parametrize("mode", ["delta", "staged", "staged+delta"])
def test_a_replica_added_after_three_updates_catches_up_from_a_peer_not_from_the_actor_wg(
        cluster: Cluster, mode: str) -> None:
    """With ``delta`` the peer serves the copy its receiver keeps, and the next update is a delta for every replica
    (staged too: the newcomer's engine for it keeps what the unstaged catch-up's held); with ``staged`` alone it
    serves its host's staging area (it is the host's stager), and the next update is full for every replica, as
    every staged update without delta is. The actor rank's stream raises while the newcomer catches up
    (``connect``): it is not read."""
    delta = "delta" in mode
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=delta, staged="staged" in mode,
                                                        timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (1, 2, 3):
        held = cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    newcomer = cluster.add()
    manager.add_replicas([newcomer])
    ray.get(cluster.actor_wg.call("set_mode", "raise_midway"))
    asyncio.run(manager.connect())
    ray.get(cluster.actor_wg.call("set_mode", "normal"))
    assert [(state.state, state.version) for state in manager.status()] == [("committed", 3)] * 3, manager.status()
    assert cluster.digests([2]) == [held] and "resume_generation" in cluster.hooks(2)
    expected = cluster.version(4)
    report = asyncio.run(manager.update_weights(version=4))
    assert [outcome.state for outcome in report.replicas] == ["committed"] * 3 and report.ok
    assert [outcome.received for outcome in report.replicas] == ["changes" if delta else "full"] * 3
    assert cluster.digests([0, 1, 2]) == [expected] * 3


@pytest.mark.parametrize("mode", ["delta", "staged"])
def test_a_catch_up_that_fails_leaves_the_newcomer_torn_and_unresumed_and_the_update_sends_everyone_the_model(
        cluster: Cluster, mode: str) -> None:
    """The peer's copy checked against a digest that is not the version's (the manager's record of it, replaced
    here: as if the peer held other bytes): the catch-up fails before the newcomer is resumed, it is named torn in
    ``joined``, and the update then sends every replica the full model, which repairs it."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=mode == "delta",
                                                        staged=mode == "staged",
                                                        timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (1, 2):
        cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    newcomer = cluster.add()
    manager.add_replicas([newcomer])
    manager._model = "0" * 32  # noqa: SLF001 - the fault: the version's digest, as the peer's copy must match it
    expected = cluster.version(3)
    report = asyncio.run(manager.update_weights(version=3))
    [joined] = report.joined
    assert (joined.replica, joined.state, joined.resumed) == (2, "torn", False), joined
    assert "DigestMismatchError" in str(joined.error) and "(peer)" in str(joined.error), joined.error
    assert "resume_generation" not in cluster.hooks(2)[:-2]  # resumed only by the update that repaired it
    assert report.ok and [outcome.received for outcome in report.replicas] == ["full"] * 3
    assert cluster.digests([0, 1, 2]) == [expected] * 3


def test_a_peer_that_no_longer_holds_the_version_refuses_at_once_and_the_update_sends_everyone_the_model(
        cluster: Cluster) -> None:
    """Staged: an update whose actor stream raised half-way left every replica serving version 2, and the stager's
    area unsealed. The replica that joins then is caught up from that stager, which refuses (it no longer holds
    version 2) and aborts the catch-up's stream: the newcomer stops waiting at once, not at the transfer timeout
    (30 s here), is named torn, and the update sends every replica the full model."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, staged=True,
                                                        timeouts=StepTimeouts(setup=30, transfer=30)))
    for version in (1, 2):
        cluster.version(version)
        asyncio.run(manager.update_weights(version=version))
    ray.get(cluster.actor_wg.call("set_mode", "raise_midway"))
    with pytest.raises(WeightsyncError):
        asyncio.run(manager.update_weights(version=3))
    ray.get(cluster.actor_wg.call("set_mode", "normal"))
    manager.add_replicas([cluster.add()])
    expected = cluster.version(3)
    report = asyncio.run(manager.update_weights(version=3))
    [joined] = report.joined
    assert (joined.state, joined.resumed) == ("torn", False) and "cannot serve version 2" in str(joined.error)
    assert report.stages["catch_up"] < 10, report.stages  # a liveness bound: the transfer timeout is 30 s
    assert report.ok and [outcome.received for outcome in report.replicas] == ["full"] * 3
    assert cluster.digests([0, 1, 2]) == [expected] * 3


def test_without_delta_or_staged_a_joining_replica_is_told_to_take_the_full_update(cluster: Cluster,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024))
    asyncio.run(manager.update_weights())
    with caplog.at_level("WARNING", logger="weightsync.core.control.manager"):
        manager.add_replicas([cluster.add()])
    assert "catch-up from a peer needs SyncConfig(delta=True) or staged=True" in caplog.text
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
    assert "catch_up" in report.stages, report.stages
    assert [outcome.received for outcome in report.replicas] == ["changes"] * 2
    assert cluster.digests([0, 2]) == [expected] * 2


def test_the_ray_adapters_workers_are_peers_and_a_worker_whose_actor_cannot_serve_is_not() -> None:
    """``RayRolloutReplica.create``'s workers serve a joining replica (``PeerWorker``); the staging worker class
    (over any actor with ``stage_weights``) does not claim to, so the manager never picks one as a peer."""
    from weightsync.api.peers import PeerWorker
    from weightsync.ray import RayHostWorker, RayStagingWorker

    assert isinstance(RayHostWorker(None, name="worker0"), PeerWorker)
    assert not isinstance(RayStagingWorker(None, name="worker0"), PeerWorker)
