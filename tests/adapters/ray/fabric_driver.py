"""The driver of test_rails' trainer-fabric test, run inside the testbed's head host: an FSDP2 ``actor_wg`` of two
ranks on two hosts (rank 0 on host 1, rank 1 on host 0) whose own gloo group runs over rail 1 of theirs (the
trainer's fabric, ``GLOO_SOCKET_IFNAME=eth1``), and a replica of two workers on host 2, both on rail 0 (local ranks 0
and 2 of a host of two rails), ``backend="auto"``. Mode ``sharded``: each rank sends its own blocks
(``FsdpTpSource``); ``gathered``: every rank gathers each tensor and rank 0 sends them (``FsdpTpGathered``). It
commits one update, then asks the test to read the rails' counters before and after a second one.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import ray

from tests.tools.testbed.driving import DriverChannel
from tests.workloads import FsdpTpGathered, FsdpTpSource, RecordingSink
from weightsync.api.config import MiB, StepTimeouts, SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    mode = sys.argv[2]
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg = RayActorWorkerGroup.create(world_size=2, node_id=[nodes["1"], nodes["0"]],
                                          source_factory=FsdpTpSource if mode == "sharded" else FsdpTpGathered)
    address = ray.get(actor_wg.handles[0].call.remote("rail_address", 1))
    ray.get(actor_wg.call("join", f"tcp://{address}:29613", "eth1"))
    replica = RayRolloutReplica.create(replica=0, sink_factory=RecordingSink, num_workers=2, node_id=nodes["2"],
                                       local_ranks=[0, 2])
    config = SyncConfig(bucket_bytes=1 * MiB, timeouts=StepTimeouts(transfer=60, setup=60))
    manager = CheckpointEngineManager(backend="auto", actor_wg=actor_wg, replicas=[replica], config=config)
    ray.get(actor_wg.call("set_version", 1))
    result: dict[str, Any] = {"first": asyncio.run(manager.update_weights()).ok}
    result["expected"] = ray.get(actor_wg.call("set_version", 3))[0]
    channel.ask({"mark": "before"})
    report = asyncio.run(manager.update_weights())
    channel.ask({"mark": "after"})
    result.update(ok=report.ok, nbytes=report.nbytes, chosen=report.chosen,
                  sent=[transfer.nbytes for transfer in report.transfers if transfer.role == "actor"],
                  digests=ray.get(replica.call("digest")))
    channel.tell({"result": result})
    replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
