"""Two raylets on this machine: gloo crosses nodes; shm refuses, naming both nodes and what would work."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray

from tests.conftest import RayNodes
from tests.workloads import ModelSource, RecordingSink, model_tensors, weights_digest
from weightsync.api.config import SyncConfig
from weightsync.api.errors import TopologyError
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica


@pytest.fixture(scope="module")
def split(ray_nodes: RayNodes) -> Iterator[tuple[RayActorWorkerGroup, list[RayRolloutReplica]]]:
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=ModelSource, node_id=ray_nodes.head)
    replicas = [
        RayRolloutReplica.create(replica=0, sink_factory=RecordingSink, node_id=ray_nodes.head),
        RayRolloutReplica.create(replica=1, sink_factory=RecordingSink, node_id=ray_nodes.other),
    ]
    try:
        yield actor_wg, replicas
    finally:
        actor_wg.shutdown()
        for replica in replicas:
            replica.shutdown()


def test_actors_really_are_on_two_nodes(split: tuple[RayActorWorkerGroup, list[RayRolloutReplica]],
                                        ray_nodes: RayNodes) -> None:
    _, replicas = split
    nodes = [ray.get(replica.workers[0].handle.node_id.remote()) for replica in replicas]
    assert nodes == [ray_nodes.head, ray_nodes.other]


def test_gloo_crosses_nodes(split: tuple[RayActorWorkerGroup, list[RayRolloutReplica]]) -> None:
    actor_wg, replicas = split
    manager = CheckpointEngineManager(backend="gloo", actor_wg=actor_wg, replicas=replicas,
                                      config=SyncConfig(bucket_bytes=256 * 1024))
    report = asyncio.run(manager.update_weights())
    assert report.ok
    expected = weights_digest(model_tensors(1))
    assert [ray.get(replica.call("digest")[0]) for replica in replicas] == [expected, expected]


def test_shm_refuses_a_peer_on_another_node(split: tuple[RayActorWorkerGroup, list[RayRolloutReplica]],
                                            ray_nodes: RayNodes) -> None:
    actor_wg, replicas = split
    manager = CheckpointEngineManager(backend="shm", actor_wg=actor_wg, replicas=replicas)
    with pytest.raises(TopologyError) as caught:
        asyncio.run(manager.update_weights())
    message = str(caught.value)
    assert ray_nodes.head in message and ray_nodes.other in message
    assert "gloo (installed)" in message
    # The refused update moved nothing, so both replicas were resumed with what they had.
    assert [status.state for status in manager.status()] == ["untouched", "untouched"]
