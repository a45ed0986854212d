"""The driver of test_rails' rail fault, run inside the testbed's head host (``backend="auto"``).

Placement (hosts by index): an actor worker group of K ranks on host 1 (one per rail), one replica of K workers on
host 2; auto deals the update into K stripes. Mid-update the test cuts a rail of host 2 (as it is asked: drop or
carrier); the driver reports what the update raised, how long it took, and each replica's state and pause/resume
hooks; then the next update, the rail still down (reading the rails' counters around it); then, the rail restored,
one more. The third argument (JSON): ``rails`` (K, default 2), ``staged`` (the updates are staged), ``parts`` (the
replica instead has four workers, two on host 0 and two on host 2, one per rail; host 0's hold the first half of the
layers, host 2's the rest: two part groups, each a stream over a rail of its own, host 2's over rail 1).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from typing import Any

import ray

from tests.adapters.ray.leader_fault_driver import update_with_fault
from tests.tools.testbed.driving import DriverChannel
from tests.workloads import ModelSource, RecordingSink, model_tensors, weights_digest
from weightsync.api.parts import Part
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

TRANSFER_TIMEOUT = 6.0
NUMEL = 250_000


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    mode = sys.argv[2]
    options: dict[str, Any] = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    rails = options.get("rails", 2)
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg = RayActorWorkerGroup.create(world_size=rails, source_factory=functools.partial(ModelSource, numel=NUMEL),
                                          node_id=nodes["1"])
    names = [name for name, _ in model_tensors(0, numel=NUMEL)]
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    if options.get("parts", False):  # each host's workers hold one half: the Part lists what they do not hold
        held = [halves[0]] * rails + [halves[1]] * rails
        replica = RayRolloutReplica.create(replica=0, sink_factory=RecordingSink, num_workers=2 * rails,
                                           node_id=[nodes["0"]] * rails + [nodes["2"]] * rails,
                                           parts=[Part(tensors={name: () for name in names if name not in mine})
                                                  for mine in held])
    else:
        held = [names] * rails
        replica = RayRolloutReplica.create(replica=0, sink_factory=RecordingSink, num_workers=rails,
                                           node_id=nodes["2"])
    config = SyncConfig(bucket_bytes=256 * 1024, staged=options.get("staged", False),
                        timeouts=StepTimeouts(transfer=TRANSFER_TIMEOUT, setup=60))
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=[replica], config=config)
    first = asyncio.run(manager.update_weights())
    result: dict[str, Any] = {"first": first.ok, "chosen": first.chosen}
    ray.get(actor_wg.call("set_mode", "normal", 0.15))  # 12 tensors, ~1.8 s of streaming
    result["faulted"] = asyncio.run(update_with_fault(manager, lambda: channel.ask({"cut": mode})))
    result["states"] = [(status.state, status.resumed) for status in manager.status()]
    result["hooks"] = ray.get(replica.call("hook_log"))
    ray.get(actor_wg.call("set_mode", "normal", 0.0))
    for step, version in (("down", 7), ("restored", 8)):
        if step == "restored":
            channel.ask({"restore": True})
        ray.get(actor_wg.call("set_version", version))
        tensors = dict(model_tensors(version, numel=NUMEL))
        expected = [weights_digest([(name, tensors[name]) for name in mine]) for mine in held]
        channel.ask({"mark": f"{step} before"})
        report = asyncio.run(manager.update_weights())
        channel.ask({"mark": f"{step} after"})
        result[step] = {"ok": report.ok, "chosen": report.chosen, "nbytes": report.nbytes,
                        "whole": list(ray.get(replica.call("digest"))) == expected}
    channel.tell({"result": result})
    replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
