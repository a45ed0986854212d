"""A delta update consults ``copy_into``'s fallback exactly as a full update does: a tensor the consumer has no
destination for — from the start, added between versions, or given a destination by the fallback itself — is
delivered whole, bit-exact, update after update.

What the replicas hold is hashed by each worker from its own tensors (``tests.workloads.weights_digest``) and
compared with the same hash of the sender's version; what reached the fallback is recorded by the sink.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.ray_cluster import Cluster, running_cluster
from tests.workloads import (ADDED, AddedByFallbackSink, DeltaModelSource, FallbackSink, GrowingDeltaSource,
                             OnDemandSink, delta_model)
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager

DELTA_UPDATES = 10


@pytest.fixture
def cluster(request: pytest.FixtureRequest, ray_nodes: RayNodes) -> Iterator[Cluster]:
    source, sink = request.param
    with running_cluster(ray_nodes, source) as made:
        made.add(sink)
        yield made


def update(manager: CheckpointEngineManager, cluster: Cluster, version: int) -> UpdateReport:
    expected = cluster.version(version)
    report = asyncio.run(manager.update_weights(version=version))
    assert report.ok, (version, report.replicas)
    assert cluster.digests() == [expected], f"version {version}"
    return report


def fallback_log(cluster: Cluster) -> list[list[str]]:
    """The names the replica's fallback was given, update by update (sorted)."""
    return [sorted(names) for names in ray.get(cluster.replicas[0].call("fallback_log")[0])]


def run_updates(cluster: Cluster) -> list[UpdateReport]:
    manager = CheckpointEngineManager(backend="shm", actor_wg=cluster.actor_wg, replicas=cluster.replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024, delta=True,
                                                        timeouts=StepTimeouts(transfer=30, setup=30)))
    reports = [update(manager, cluster, version) for version in range(1, DELTA_UPDATES + 2)]
    assert [report.replicas[0].received for report in reports] == ["full"] + ["changes"] * DELTA_UPDATES
    return reports


@pytest.mark.parametrize("cluster", [(DeltaModelSource, FallbackSink)], indirect=True)
def test_tensors_only_the_fallback_takes_are_delivered_in_every_delta_update(cluster: Cluster) -> None:
    run_updates(cluster)
    # One of them split across buckets, the other small; every update hands the fallback each once, whole.
    assert fallback_log(cluster) == [sorted(FallbackSink.without)] * (DELTA_UPDATES + 1)


@pytest.mark.parametrize("cluster", [(GrowingDeltaSource, AddedByFallbackSink)], indirect=True)
def test_a_tensor_added_between_versions_reaches_the_fallback_dense_then_changed(cluster: Cluster) -> None:
    run_updates(cluster)
    assert fallback_log(cluster) == [[]] + [[ADDED]] * DELTA_UPDATES


@pytest.mark.parametrize("cluster", [(GrowingDeltaSource, OnDemandSink)], indirect=True)
def test_a_fallback_that_creates_destinations_is_asked_once_per_new_tensor(cluster: Cluster) -> None:
    run_updates(cluster)
    log = fallback_log(cluster)
    assert log[0] == sorted(name for name, _ in delta_model(1)) and log[1] == [ADDED], log[:2]
    assert log[2:] == [[]] * (DELTA_UPDATES - 1)  # from then on every tensor has its destination
