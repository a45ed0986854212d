"""The driver of test_across_hosts' leader fault, run inside the testbed's head host (``backend="auto"``).

Placement (hosts by index): the actor worker group on host 1; replica 0 with two workers on host 2; replicas 1 and
2 with one worker each on host 3. ``auto`` picks the two-level chain: host 2's leader is replica0/worker0, host 3's
replica1/worker0 (downstream of host 2's), and replica2/worker0 reads host 3's leader's ring in place. Mid-update
the driver kills host 3's leader (through Ray: the driver cannot see host 3's processes), then removes its replica
and commits the next update, in which replica 2's worker leads host 3.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import ray

from tests.tools.testbed.driving import DriverChannel
from tests.workloads import ModelSource, RecordingSink
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import WeightsyncError
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

TRANSFER_TIMEOUT = 6.0
FAULT_AFTER_S = 0.6


async def update_with_fault(manager: CheckpointEngineManager, fault: Callable[[], Any]) -> dict[str, Any]:
    """An update, with ``fault()`` (in a thread) ``FAULT_AFTER_S`` into it: how long it took and what it raised."""
    started = time.perf_counter()
    task = asyncio.create_task(manager.update_weights())
    await asyncio.sleep(FAULT_AFTER_S)
    await asyncio.to_thread(fault)
    try:
        await task
    except WeightsyncError as error:
        return {"seconds": time.perf_counter() - started, "error": type(error).__name__, "message": str(error)}
    return {"seconds": time.perf_counter() - started, "error": None, "message": ""}


def placement(nodes: dict[str, str]) -> tuple[RayActorWorkerGroup, list[RayRolloutReplica]]:
    """The module docstring's placement: the actor rank on host 1, replica 0 (two workers) on host 2, replicas 1
    and 2 on host 3."""
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=ModelSource, node_id=nodes["1"])
    replicas = [RayRolloutReplica.create(replica=0, sink_factory=RecordingSink, num_workers=2, node_id=nodes["2"]),
                *(RayRolloutReplica.create(replica=r, sink_factory=RecordingSink, node_id=nodes["3"])
                  for r in (1, 2))]
    return actor_wg, replicas


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg, replicas = placement(nodes)
    config = SyncConfig(bucket_bytes=256 * 1024, timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=60))
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=replicas, config=config)
    result: dict[str, Any] = {"first": asyncio.run(manager.update_weights()).ok}
    ray.get(actor_wg.call("set_mode", "normal", 0.15))  # 12 tensors, ~1.8 s of streaming
    victim = replicas[1].workers[0].handle
    result["faulted"] = asyncio.run(update_with_fault(manager, lambda: ray.kill(victim)))
    result["states"] = [status.state for status in manager.status()]
    survivors = [replicas[0], replicas[2]]
    result["hooks"] = [ray.get(replica.call("hook_log")) for replica in survivors]
    manager.remove_replicas([replicas[1]])
    ray.get(actor_wg.call("set_mode", "normal", 0.0))
    result["expected"] = ray.get(actor_wg.call("set_version", 9))[0]
    report = asyncio.run(manager.update_weights())
    result["next"] = {"ok": report.ok, "chosen": report.chosen, "rebuilt": report.rebuilt}
    result["digests"] = [digest for replica in survivors for digest in ray.get(replica.call("digest"))]
    channel.tell({"result": result})
    for replica in survivors:
        replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
