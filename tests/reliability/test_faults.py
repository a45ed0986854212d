"""The fault matrix, with real Ray worker processes killed, stopped and corrupted mid-transfer.

Every case without eviction ends within the configured transfer timeout + 1 s (plus the fixed pause/resume round
trips), never resumes a torn replica, and recovers on the next update. A rollout worker killed or stopped mid-update
is evicted (``SyncConfig.max_evicted``, on by default) and the same call commits the other replica, within the
transfer timeout + the fleet's setup time + 2 × one update's time (+ the eviction's ping for a silent one).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, running_cluster
from tests.workloads import ModelSource, model_tensors, weights_digest
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import (
    DigestMismatchError,
    HostUnreachableError,
    StepTimeoutError,
    WeightsyncError,
    WorkerError,
)
from weightsync.api.types import UpdateReport
from weightsync.core.control.eviction import PING_S
from weightsync.core.control.manager import CheckpointEngineManager

# The one-sided chain backends fail differently (a dead middle hop starves everything downstream of it), so the
# kill, stall and corruption cases run for them too.
ALL_CPU_BACKENDS = ["shm", "gloo", "nixl", "mooncake"]
TRANSFER_TIMEOUT = 6.0
SLACK = 1.0  # the bound: the configured timeout + 1 s, pause and resume round trips included


def config(**options: object) -> SyncConfig:
    return SyncConfig(bucket_bytes=256 * 1024, timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=30),
                      backend_options=dict(options))  # type: ignore[arg-type]


@pytest.fixture
def cluster(ray_nodes: RayNodes) -> Iterator[Cluster]:
    with running_cluster(ray_nodes, ModelSource, replicas=2) as made:
        yield made


async def _update_with_fault(manager: CheckpointEngineManager, fault: object, *, after: float
                             ) -> tuple[float, BaseException | UpdateReport]:
    """Start an update, inject ``fault()`` ``after`` seconds in, return (seconds, the error it ended with, or its
    report)."""
    started = time.perf_counter()
    task = asyncio.create_task(manager.update_weights())
    await asyncio.sleep(after)
    fault()  # type: ignore[operator]
    try:
        report = await task
    except WeightsyncError as exc:
        return time.perf_counter() - started, exc
    return time.perf_counter() - started, report


def _bound(manager: CheckpointEngineManager, cluster: Cluster) -> float:
    """The first update (its setup time) and one slow update's time: the bound of an update that evicts."""
    first = asyncio.run(manager.update_weights())
    _slow(cluster)
    plain = asyncio.run(manager.update_weights())
    return TRANSFER_TIMEOUT + first.stages["setup"] + 2 * plain.seconds


def _slow(cluster: Cluster) -> None:
    ray.get(cluster.actor_wg.call("set_mode", "normal", 0.15))  # 12 tensors, ~1.8 s of streaming


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_rollout_worker_killed_mid_transfer_is_evicted_and_the_other_commits(cluster: Cluster, backend: str) -> None:
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    bound = _bound(manager, cluster)
    expected = ray.get(cluster.actor_wg.call("set_version", 7))[0]
    victim, dead = cluster.pid(1), cluster.replicas[1]
    seconds, report = asyncio.run(_update_with_fault(manager, lambda: os.kill(victim, signal.SIGKILL), after=0.6))
    assert isinstance(report, UpdateReport), repr(report)
    assert seconds < bound and report.pause_seconds < bound, (seconds, report.pause_seconds, bound)
    assert [(outcome.replica, outcome.state) for outcome in report.evicted] == [(1, "evicted")]
    assert "WorkerDiedError: replica1" in str(report.evicted[0].error)
    assert [outcome.state for outcome in report.replicas] == ["committed"] and report.ok
    assert cluster.digests([0]) == [expected] and cluster.hooks(0)[-1] == "resume_generation"
    assert manager.replicas == (cluster.replicas[0],)
    cluster.replicas.remove(dead)


def test_with_eviction_off_a_killed_rollout_worker_fails_the_update(cluster: Cluster) -> None:
    """``max_evicted=0``, the negative control of the test above: the update fails naming the replica, the dead
    one stays torn, the other committed or torn (paused, never resumed torn), until the caller removes it."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=dataclasses.replace(config(), max_evicted=0))
    asyncio.run(manager.update_weights())
    _slow(cluster)
    victim = cluster.pid(1)
    seconds, error = asyncio.run(_update_with_fault(manager, lambda: os.kill(victim, signal.SIGKILL), after=0.6))
    assert isinstance(error, WorkerError) and "replica1" in str(error), repr(error)
    assert seconds < TRANSFER_TIMEOUT + SLACK
    states = manager.status()
    assert states[1].state == "torn"
    assert states[0].state in ("committed", "torn")
    if states[0].state == "torn":
        assert cluster.hooks(0)[-1] == "release_kv_cache"  # paused, never resumed torn
    dead = cluster.replicas[1]
    manager.remove_replicas([dead])
    ray.get(cluster.actor_wg.call("set_mode", "normal", 0.0))
    expected = ray.get(cluster.actor_wg.call("set_version", 7))[0]
    report = asyncio.run(manager.update_weights())
    assert [outcome.state for outcome in report.replicas] == ["committed"]
    assert cluster.digests([0]) == [expected]
    cluster.replicas.remove(dead)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_actor_rank_0_killed_mid_transfer(cluster: Cluster, backend: str) -> None:
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    asyncio.run(manager.update_weights())
    _slow(cluster)
    sender = int(ray.get(cluster.actor_wg.call("pid")[0]))
    seconds, error = asyncio.run(_update_with_fault(manager, lambda: os.kill(sender, signal.SIGKILL), after=0.6))
    assert isinstance(error, WorkerError) and "actor rank 0" in str(error), repr(error)
    assert seconds < TRANSFER_TIMEOUT + SLACK
    for index, status in enumerate(manager.status()):
        if status.state == "torn":
            assert cluster.hooks(index)[-1] == "release_kv_cache"
        else:
            assert status.state == "committed" and cluster.hooks(index)[-1] == "resume_generation"
    assert any(status.state == "torn" for status in manager.status())


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_stalled_receiver_times_out_naming_it_and_recovers(cluster: Cluster, backend: str) -> None:
    """Eviction off: a stopped receiver is a timeout naming it (with eviction it is evicted: the next test)."""
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=dataclasses.replace(config(), max_evicted=0))
    asyncio.run(manager.update_weights())
    _slow(cluster)
    victim = cluster.pid(1)
    try:
        seconds, error = asyncio.run(_update_with_fault(manager, lambda: os.kill(victim, signal.SIGSTOP), after=0.6))
    finally:
        os.kill(victim, signal.SIGCONT)
    assert isinstance(error, StepTimeoutError), repr(error)
    # Its host answers through the other workers: a stuck worker is not reported as a host that is down.
    assert not isinstance(error, HostUnreachableError), repr(error)
    assert error.step == "transfer" and "replica1/worker0" in error.workers
    assert seconds < TRANSFER_TIMEOUT + SLACK
    assert manager.status()[1].state == "torn"
    ray.get(cluster.actor_wg.call("set_mode", "normal", 0.0))
    expected = ray.get(cluster.actor_wg.call("set_version", 9))[0]
    report = asyncio.run(manager.update_weights())
    assert report.ok and cluster.digests([0, 1]) == [expected, expected]


def test_a_stopped_receiver_is_evicted_as_silent_and_the_other_commits(cluster: Cluster) -> None:
    """SIGSTOP: the worker misses the transfer's deadline and does not answer the ping after it (``PING_S``)."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    bound = _bound(manager, cluster) + PING_S
    expected = ray.get(cluster.actor_wg.call("set_version", 9))[0]
    victim, silent = cluster.pid(1), cluster.replicas[1]
    try:
        seconds, report = asyncio.run(_update_with_fault(manager, lambda: os.kill(victim, signal.SIGSTOP),
                                                         after=0.6))
    finally:
        os.kill(victim, signal.SIGCONT)
    assert isinstance(report, UpdateReport), repr(report)
    assert seconds < bound, (seconds, bound)
    [evicted] = report.evicted
    assert evicted.replica == 1 and "replica1/worker0 did not answer a ping" in str(evicted.error), evicted
    assert report.ok and cluster.digests([0]) == [expected] and manager.replicas == (cluster.replicas[0],)


@pytest.mark.parametrize("backend", ALL_CPU_BACKENDS)
def test_bit_flip_in_transit_is_caught_and_repaired(cluster: Cluster, backend: str) -> None:
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config(transport_hook="tests.workloads:FLIP_ONCE"))
    with pytest.raises(DigestMismatchError):
        asyncio.run(manager.update_weights())
    torn = [index for index, status in enumerate(manager.status()) if status.state == "torn"]
    assert torn
    for index in torn:
        assert cluster.hooks(index)[-1] == "release_kv_cache"
    expected = ray.get(cluster.actor_wg.call("set_version", 3))[0]
    assert asyncio.run(manager.update_weights()).ok
    assert cluster.digests([0, 1]) == [expected, expected]


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_replicas_added_and_removed_between_updates(cluster: Cluster, backend: str) -> None:
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    asyncio.run(manager.update_weights())
    newcomer = cluster.add()
    manager.add_replicas([newcomer])
    expected = ray.get(cluster.actor_wg.call("set_version", 4))[0]
    report = asyncio.run(manager.update_weights())
    assert report.rebuilt and report.receivers == 3
    assert cluster.digests([0, 1, 2]) == [expected] * 3  # the newcomer got the full weights
    manager.remove_replicas([cluster.replicas[0]])
    expected = ray.get(cluster.actor_wg.call("set_version", 5))[0]
    report = asyncio.run(manager.update_weights())
    assert report.receivers == 2 and cluster.digests([1, 2]) == [expected, expected]
    assert cluster.digests([0]) != [expected]  # the removed replica was left alone
    assert weights_digest(model_tensors(5)) == expected


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_cancelling_an_update_behaves_like_a_failure(cluster: Cluster, backend: str) -> None:
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    asyncio.run(manager.update_weights())
    _slow(cluster)

    async def cancel_mid_transfer() -> float:
        task = asyncio.create_task(manager.update_weights())
        await asyncio.sleep(0.6)
        started = time.perf_counter()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.perf_counter() - started

    assert asyncio.run(cancel_mid_transfer()) < SLACK  # cleanup ran promptly, it did not wait for the transfer
    for index, status in enumerate(manager.status()):
        assert status.state == "torn"
        assert cluster.hooks(index)[-1] == "release_kv_cache"  # paused, not resumed torn
    ray.get(cluster.actor_wg.call("set_mode", "normal", 0.0))
    expected = ray.get(cluster.actor_wg.call("set_version", 8))[0]
    report = asyncio.run(manager.update_weights())  # connections were reset: this update rebuilds them
    assert report.rebuilt and report.ok and cluster.digests([0, 1]) == [expected, expected]
