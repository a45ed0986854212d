"""The driver of one cross-host fault case, run inside the testbed's head host (see test_host_faults).

It joins the testbed's Ray cluster, places the actor worker group on one host and one replica on each of two
others, commits an update, then starts a slow update and asks the test (one JSON line on stdout) to take a host's
link down; once that update has ended (failed, or evicted the cut host's replica) it asks for the link back, adds an evicted
replica back, commits the next update, and prints what it saw
as one JSON line. The test reads the bytes the replicas hold through Ray calls made here, and everything that
decides pass or fail is asserted by the test, not here.

Lines on stdout: {"fault": host} (answer a line on stdin once the link is down), {"restore": host} (answer once it
is up), then {"result": {...}}. Everything else the process prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
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
SLOW_TENSOR_S = 0.15  # 12 tensors: about 1.8 s of streaming, so the fault lands mid-update


def describe(error: BaseException) -> dict[str, Any]:
    return {"type": type(error).__name__, "message": str(error), "notes": list(getattr(error, "__notes__", [])),
            "details": {key: value for key, value in getattr(error, "details", {}).items()
                        if isinstance(value, (str, int, float, bool, list))}}


async def faulted_update(manager: CheckpointEngineManager, channel: DriverChannel, host: int) -> dict[str, Any]:
    started = time.perf_counter()
    task = asyncio.create_task(manager.update_weights())
    await asyncio.sleep(FAULT_AFTER_S)
    channel.ask({"fault": host})
    try:
        report = await task
    except WeightsyncError as error:
        return {"seconds": time.perf_counter() - started, "error": describe(error)}
    return {"seconds": time.perf_counter() - started, "error": None,
            "evicted": [[outcome.replica, outcome.error] for outcome in report.evicted]}


def main() -> None:
    backend, victim = sys.argv[1], int(sys.argv[2])
    node_ids: dict[str, str] = json.loads(sys.argv[3])  # host index -> Ray node id
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=ModelSource, node_id=node_ids["1"])
    replicas = [RayRolloutReplica.create(replica=r, sink_factory=RecordingSink, node_id=node_ids[str(2 + r)])
                for r in range(2)]
    config = SyncConfig(bucket_bytes=256 * 1024, timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=60))
    manager = CheckpointEngineManager(backend=backend, actor_wg=actor_wg, replicas=replicas, config=config)

    def digests() -> list[str]:
        return [ray.get(replica.call("digest")[0]) for replica in replicas]

    def hooks() -> list[list[str]]:
        return [list(ray.get(replica.call("hook_log")[0])) for replica in replicas]

    first = asyncio.run(manager.update_weights())
    result: dict[str, Any] = {"first": first.ok, "chosen": first.chosen}
    result["expected_faulted"] = ray.get(actor_wg.call("set_version", 5))[0]
    ray.get(actor_wg.call("set_mode", "normal", SLOW_TENSOR_S))
    result["faulted"] = asyncio.run(faulted_update(manager, channel, victim))
    result["states"] = [status.state for status in manager.status()]
    channel.ask({"restore": victim})  # the victim's replica answers Ray calls only once its link is back
    result["hooks_after_fault"] = hooks()
    result["digests_after_fault"] = digests()
    evicted = [replicas[index] for index, _ in result["faulted"].get("evicted", [])]
    manager.add_replicas(evicted)  # back in (link restored): it takes the next update with the others
    ray.get(actor_wg.call("set_mode", "normal", 0.0))
    result["expected"] = ray.get(actor_wg.call("set_version", 7))[0]
    try:
        report = asyncio.run(manager.update_weights())
        result["next"] = {"ok": report.ok, "states": [outcome.state for outcome in report.replicas]}
    except WeightsyncError as error:
        result["next"] = {"ok": False, "error": describe(error)}
    result["digests"] = digests()
    result["hooks"] = hooks()
    channel.tell({"result": result})
    for replica in replicas:
        replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
