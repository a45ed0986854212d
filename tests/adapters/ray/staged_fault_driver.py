"""The driver of test_across_hosts' staged faults, run inside the testbed's head host (``backend="auto"``, staged).

Placement (hosts by index, as the leader fault driver's): the actor worker group on host 1; replica 0 with two
workers on host 2; replicas 1 and 2 with one worker each on host 3. Host 2's stager is replica0/worker0, host 3's replica1/worker0. Each fault
strikes while the update is being staged, the replicas serving:
1. host 3's link is cut (every packet dropped): the test cuts it when asked, and restores it after the update
   failed (the replicas' logs are read then: host 3 cannot be reached while it is cut);
2. host 3's stager (replica 1's worker) is killed (through Ray): the update evicts replica 1 and restages host 3
   for replica 2 in the same call (a second transfer), replica 2 serving until its swap;
3. the actor rank is killed (through Ray).
After each, the driver records every replica's own pause/resume log, the manager's states and what each worker
holds; after the first it commits the next update over the restored link.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import ray

from tests.adapters.ray.leader_fault_driver import TRANSFER_TIMEOUT, placement, update_with_fault
from tests.tools.testbed.driving import DriverChannel
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayRolloutReplica


def observe(manager: CheckpointEngineManager, replicas: list[RayRolloutReplica]) -> dict[str, Any]:
    return {
        "states": [[state.state, state.version, state.resumed, state.pause_seconds] for state in manager.status()],
        "hooks": [ray.get(replica.call("hook_log")) for replica in replicas],
        "digests": [digest for replica in replicas for digest in ray.get(replica.call("digest"))],
    }


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg, replicas = placement(nodes)
    config = SyncConfig(bucket_bytes=256 * 1024, staged=True,
                        timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=60))
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=replicas, config=config)
    result: dict[str, Any] = {"first": asyncio.run(manager.update_weights(version=1)).ok}
    result["v1"] = ray.get(actor_wg.call("set_version", 1))[0]
    ray.get(actor_wg.call("set_version", 2))
    ray.get(actor_wg.call("set_mode", "normal", 0.15))  # 12 tensors, ~1.8 s of streaming
    result["cut"] = asyncio.run(update_with_fault(manager, lambda: channel.ask({"cut": 3})))
    channel.ask({"restore": 3})  # host 3's workers answer the driver again (a pause sent meanwhile would show)
    result["after_cut"] = observe(manager, replicas)
    ray.get(actor_wg.call("set_mode", "normal", 0.0))
    result["v3"] = ray.get(actor_wg.call("set_version", 3))[0]
    report = asyncio.run(manager.update_weights(version=3))
    result["repaired"] = {"ok": report.ok, "rebuilt": report.rebuilt, **observe(manager, replicas)}
    ray.get(actor_wg.call("set_mode", "normal", 0.15))
    result["v4"] = ray.get(actor_wg.call("set_version", 4))[0]
    stager = replicas[1].workers[0].handle
    result["evicting"] = asyncio.run(update_with_fault(manager, lambda: ray.kill(stager)))
    survivors = [replicas[0], replicas[2]]
    result["after_evict"] = observe(manager, survivors)
    ray.get(actor_wg.call("set_version", 5))
    result["killed"] = asyncio.run(update_with_fault(manager, lambda: ray.kill(actor_wg.handles[0])))
    result["after_kill"] = observe(manager, survivors)
    channel.tell({"result": result})
    for replica in survivors:
        replica.shutdown()


if __name__ == "__main__":
    main()
