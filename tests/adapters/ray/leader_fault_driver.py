"""The driver of test_across_hosts' leader fault, run inside the testbed's head host (``backend="auto"``).

Placement (hosts by index): the actor worker group on host 1; replica 0 with two workers on host 2; replicas 1 and
2 with one worker each on host 3. ``auto`` picks the two-level chain: host 2's leader is replica0/worker0, host 3's
replica1/worker0 (downstream of host 2's), and replica2/worker0 reads host 3's leader's ring in place. Updates are
deltas (``SyncConfig.delta``) or full (the third argument). Mid-update the driver kills worker 0 of the replica its second argument names (through
Ray: the driver cannot see the hosts' processes) — 0: the chain's middle host's leader, its host's only replica;
1: host 3's leader, the chain's last; 2: a worker reading host 3's ring in place. The update evicts that replica and
still commits the others in the same call (a second transfer for those the first tore); the next update, with no
user call, is a delta for every survivor where updates are.
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
from weightsync.api.types import UpdateReport
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
        report = await task
    except WeightsyncError as error:
        return {"seconds": time.perf_counter() - started, "error": type(error).__name__, "message": str(error)}
    return {"seconds": time.perf_counter() - started, "error": None, "message": "", **summary(report)}


def last_pause(clock: list[tuple[str, float]]) -> float:
    """A worker's own record of its last pause: from its last ``abort_all_requests`` to the ``resume_generation``
    after it (its hooks' monotonic times)."""
    start = max(index for index, (hook, _) in enumerate(clock) if hook == "abort_all_requests")
    resumed = next(at for hook, at in clock[start:] if hook == "resume_generation")
    return resumed - clock[start][1]


def summary(report: UpdateReport) -> dict[str, Any]:
    """What the test checks of an update's report."""
    return {"ok": report.ok, "chosen": report.chosen, "rebuilt": report.rebuilt, "stages": dict(report.stages),
            "states": [outcome.state for outcome in report.replicas],
            "received": [outcome.received for outcome in report.replicas],
            "pauses": [outcome.pause_seconds for outcome in report.replicas],
            "evicted": [(outcome.replica, outcome.error) for outcome in report.evicted]}


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
    killed, delta = int(sys.argv[2]), sys.argv[3] == "delta"
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg, replicas = placement(nodes)
    config = SyncConfig(bucket_bytes=256 * 1024, delta=delta,
                        timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=60))
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=replicas, config=config)
    first = asyncio.run(manager.update_weights())
    ray.get(actor_wg.call("set_mode", "normal", 0.15))  # 12 tensors, ~1.8 s of streaming
    ray.get(actor_wg.call("set_version", 4))
    plain = asyncio.run(manager.update_weights())  # one update's time, for the bound
    result: dict[str, Any] = {"first": first.ok and plain.ok, "setup": first.stages["setup"], "update": plain.seconds}
    result["expected"] = ray.get(actor_wg.call("set_version", 5))[0]
    victim = replicas[killed].workers[0].handle
    result["faulted"] = asyncio.run(update_with_fault(manager, lambda: ray.kill(victim)))
    survivors = [replica for r, replica in enumerate(replicas) if r != killed]
    result["members"] = [next(i for i, known in enumerate(replicas) if known is replica)
                         for replica in manager.replicas]
    result["hooks"] = [ray.get(replica.call("hook_log")) for replica in survivors]
    result["own_pauses"] = [last_pause(clock) for replica in survivors for clock in ray.get(replica.call("hook_clock"))]
    result["digests"] = [digest for replica in survivors for digest in ray.get(replica.call("digest"))]
    ray.get(actor_wg.call("set_mode", "normal", 0.0))
    result["expected_next"] = ray.get(actor_wg.call("set_version", 9))[0]
    result["next"] = summary(asyncio.run(manager.update_weights()))
    result["digests_next"] = [digest for replica in survivors for digest in ray.get(replica.call("digest"))]
    channel.tell({"result": result})
    for replica in survivors:
        replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
