"""Delta updates end to end (``SyncConfig(delta=True)``), with Ray worker processes and real transports.

What the replicas hold is checked from outside the engine: each worker hashes its own tensors' raw bytes
(``tests.workloads.weights_digest``), compared with the same hash of the sender's version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, running_cluster
from tests.workloads import (DeltaModelSource, DeviceDeltaSource, DeviceInPlaceSink, InPlaceSink, MixedDeltaSource,
                             OnDemandSink, RecordingSink, RedrawnSource)
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import DigestMismatchError, WeightsyncError
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager

BUCKET = 256 * 1024


def config(*, verify_every: int = 1) -> SyncConfig:
    return SyncConfig(bucket_bytes=BUCKET, delta=True, verify_every=verify_every,
                      timeouts=StepTimeouts(transfer=30, setup=30))


@pytest.fixture
def cluster(request: pytest.FixtureRequest, ray_nodes: RayNodes) -> Iterator[Cluster]:
    """One actor rank (a :class:`DeltaModelSource`, or the source class a test passes as the parameter) and no
    replicas yet."""
    with running_cluster(ray_nodes, getattr(request, "param", DeltaModelSource)) as made:
        yield made


def update(manager: CheckpointEngineManager, cluster: Cluster, version: int) -> UpdateReport:
    expected = cluster.version(version)
    report = asyncio.run(manager.update_weights(version=version))
    assert report.ok, report.replicas
    assert cluster.digests() == [expected] * len(cluster.replicas), f"version {version}"
    return report


@pytest.mark.parametrize("backend", ["shm", "tcp", "gloo"])
def test_twenty_delta_updates_are_bit_exact(cluster: Cluster, backend: str) -> None:
    # One replica loads in place (copy_into), the other iterates views (the engine keeps a copy to rebuild them).
    cluster.add(InPlaceSink)
    cluster.add(RecordingSink)
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    first = update(manager, cluster, 1)
    assert [outcome.received for outcome in first.replicas] == ["full", "full"]
    assert first.wire_bytes >= first.nbytes and first.changed_fraction == 1.0
    for version in range(2, 21):
        report = update(manager, cluster, version)
        assert [outcome.received for outcome in report.replicas] == ["changes", "changes"], version
        # About 2 % of the elements differ between consecutive versions (a different 1 % each).
        assert 0.005 < report.changed_fraction < 0.05, report.changed_fraction
        assert report.wire_bytes < 0.15 * report.nbytes, (report.wire_bytes, report.nbytes)
        assert all(transfer.base == version - 1 for transfer in report.transfers)


@pytest.mark.parametrize("cluster", [DeviceDeltaSource, MixedDeltaSource], indirect=True)
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_accelerator_weights_update_by_deltas(cluster: Cluster, backend: str) -> None:
    # The actor's weights on the emulated accelerator (all, or every other tensor): the sender stages them to the
    # host and keeps its base there. One replica changes tensors on the accelerator in place, one iterates views.
    on_device = cluster.add(DeviceInPlaceSink)
    cluster.add(RecordingSink)
    assert "cpu" not in ray.get(on_device.call("devices")[0])
    manager = CheckpointEngineManager(backend=backend, actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    first = update(manager, cluster, 1)
    assert [outcome.received for outcome in first.replicas] == ["full", "full"]
    for version in range(2, 7):
        ray.get(on_device.call("read_back")[0])
        report = update(manager, cluster, version)
        assert [outcome.received for outcome in report.replicas] == ["changes", "changes"], version
        assert 0.005 < report.changed_fraction < 0.05, report.changed_fraction
        assert report.wire_bytes < 0.15 * report.nbytes, (report.wire_bytes, report.nbytes)
        # Each piece is read back once to be changed and summed on the host, not its whole tensor for every bucket
        # it spans (the first tensor spans three).
        assert 0 < ray.get(on_device.call("read_back")[0]) <= report.nbytes


def test_a_replica_added_later_gets_a_full_update_and_deltas_after(cluster: Cluster) -> None:
    cluster.add(InPlaceSink)
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    for version in range(1, 6):
        update(manager, cluster, version)
    manager.add_replicas([cluster.add(InPlaceSink)])
    joined = update(manager, cluster, 6)
    # One stream reaches both replicas: the newcomer needs every byte, so both get them.
    assert [outcome.received for outcome in joined.replicas] == ["full", "full"]
    assert joined.wire_bytes >= joined.nbytes
    after = update(manager, cluster, 7)
    assert [outcome.received for outcome in after.replicas] == ["changes", "changes"]
    assert after.wire_bytes < 0.15 * after.nbytes


def test_a_restarted_replica_is_repaired_by_a_full_update(cluster: Cluster) -> None:
    cluster.add(InPlaceSink)
    cluster.add(InPlaceSink)
    manager = CheckpointEngineManager(backend="tcp", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    update(manager, cluster, 1)
    update(manager, cluster, 2)
    gone = cluster.replicas.pop(1)
    manager.remove_replicas([gone])
    gone.shutdown()
    manager.add_replicas([cluster.add(InPlaceSink)])  # the same place in the fleet, a fresh process holding nothing
    report = update(manager, cluster, 3)
    assert [outcome.received for outcome in report.replicas] == ["full", "full"]
    assert [outcome.received for outcome in update(manager, cluster, 4).replicas] == ["changes", "changes"]


@pytest.mark.parametrize("verify_every", [1, 1000])
def test_a_destination_changed_behind_the_engine_is_found_and_repaired(cluster: Cluster, verify_every: int) -> None:
    cluster.add(InPlaceSink)
    cluster.add(InPlaceSink)
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config(verify_every=verify_every))
    update(manager, cluster, 1)
    update(manager, cluster, 2)
    ray.get(cluster.replicas[1].call("scribble")[0])
    expected = cluster.version(3)
    if verify_every == 1000:
        # Negative control: without the check the changed element stays wrong, unnoticed.
        report = asyncio.run(manager.update_weights(version=3))
        assert report.ok
        assert cluster.digests() != [expected, expected]
        return
    with pytest.raises(DigestMismatchError, match="holds tensors whose digest"):
        asyncio.run(manager.update_weights(version=3))
    states = manager.status()
    assert [state.state for state in states] == ["committed", "torn"]
    repaired = update(manager, cluster, 4)
    assert [outcome.received for outcome in repaired.replicas] == ["full", "full"]
    assert [outcome.received for outcome in update(manager, cluster, 5).replicas] == ["changes", "changes"]


def test_a_dense_step_goes_dense_bucket_by_bucket(cluster: Cluster) -> None:
    cluster.add(InPlaceSink)
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    ray.get(cluster.actor_wg.call("set_dense", [3])[0])
    update(manager, cluster, 1)
    update(manager, cluster, 2)
    dense = update(manager, cluster, 3)  # every element changed: every bucket but the last is sent whole
    # (the last holds six pieces at 256-byte alignment: its changes, padding left out, are the smaller encoding)
    assert [outcome.received for outcome in dense.replicas] == ["changes"]
    assert dense.changed_fraction > 0.95
    assert dense.nbytes <= dense.wire_bytes < 1.05 * dense.nbytes
    update(manager, cluster, 4)  # (back from every element changed: dense again)
    sparse = update(manager, cluster, 5)
    assert sparse.wire_bytes < 0.15 * sparse.nbytes


@pytest.mark.parametrize("cluster", [RedrawnSource], indirect=True)
def test_an_update_whose_every_bucket_went_dense_was_received_full(cluster: Cluster) -> None:
    cluster.add(OnDemandSink)  # in place, into the destinations its fallback created in the first update
    cluster.add(RecordingSink)
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    update(manager, cluster, 1)
    redrawn = update(manager, cluster, 2)  # a delta update against version 1 in which no bucket is smaller as changes
    assert [outcome.received for outcome in redrawn.replicas] == ["full", "full"]
    assert redrawn.wire_bytes >= redrawn.nbytes


def test_a_failed_update_makes_the_next_one_full(cluster: Cluster) -> None:
    cluster.add(InPlaceSink)
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=config())
    update(manager, cluster, 1)
    update(manager, cluster, 2)
    ray.get(cluster.actor_wg.call("set_mode", "raise_midway")[0])
    with pytest.raises(WeightsyncError):
        asyncio.run(manager.update_weights(version=3))
    ray.get(cluster.actor_wg.call("set_mode", "normal")[0])
    report = update(manager, cluster, 4)
    assert [outcome.received for outcome in report.replicas] == ["full"]
