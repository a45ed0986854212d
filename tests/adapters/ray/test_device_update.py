"""Accelerator tensors end to end through the manager and the Ray adapter: actor ranks yield tensors on the emulated
device (or a mix of device and host), rollout workers load them into parameters there, bit-exact."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import ray
from weightsync.api.config import SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

from tests.conftest import RayNodes
from tests.workloads import DeviceModelSource, DeviceSink, MixedModelSource, MixedSink

BUCKET = 256 * 1024


@pytest.fixture(scope="module", params=["device", "mixed"])
def world(request: pytest.FixtureRequest, ray_nodes: RayNodes) -> Iterator[tuple[RayActorWorkerGroup,
                                                                                 list[RayRolloutReplica]]]:
    mixed = request.param == "mixed"
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=MixedModelSource if mixed else DeviceModelSource,
                                          node_id=ray_nodes.head)
    replicas = [RayRolloutReplica.create(replica=index, sink_factory=MixedSink if mixed else DeviceSink,
                                         node_id=ray_nodes.head) for index in range(2)]
    try:
        yield actor_wg, replicas
    finally:
        actor_wg.shutdown()
        for replica in replicas:
            replica.shutdown()


@pytest.mark.parametrize("backend", ["shm", "gloo", "nixl"])
def test_device_weights_load_into_device_parameters_bit_exact(
    world: tuple[RayActorWorkerGroup, list[RayRolloutReplica]], backend: str
) -> None:
    actor_wg, replicas = world
    manager = CheckpointEngineManager(backend=backend, actor_wg=actor_wg, replicas=replicas,
                                      config=SyncConfig(bucket_bytes=BUCKET))
    for version in (1, 2):
        expected = ray.get(actor_wg.call("set_version", version))[0]
        report = asyncio.run(manager.update_weights(version=version))
        assert report.version == version
        digests = [ray.get(ref) for replica in replicas for ref in replica.call("digest")]
        assert digests == [expected] * len(digests)  # bytes compared on the host, outside the engine
    devices = [ray.get(ref) for replica in replicas for ref in replica.call("devices")]
    assert all("emu" in found for found in devices)
