"""The driver of test_across_hosts, run inside the testbed's head host: ``backend="auto"`` through the Ray adapter.

Placement (hosts by index): the actor worker group on host 1; two replicas of two workers each, spanning hosts 2 and
3 (worker 0 on host 2, worker 1 on host 3), so that in rank order the hosts interleave: 2, 3, 2, 3 (the rails test
passes a placement of its own). It commits one
update (the setup), then asks the test to read the link counters before and after a second one, and reports the
choice ``auto`` made and the digest every worker holds.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from typing import Any

import ray

from tests.tools.testbed.driving import DriverChannel
from tests.workloads import NUDGED, FsdpTpSource, ModelSource, RecordingSink
from weightsync.api.config import MiB, StepTimeouts, SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

NUMEL = 500_000  # 12 fp32 tensors: 24 MB a model, far above Ray's own traffic on the links


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    backend = sys.argv[2] if len(sys.argv) > 2 else "auto"
    # Another placement (the rails test): {"actor_ranks": A, "replicas": [[host of each worker], ...], "bucket_mb": B,
    # "staged": whether the updates are staged, "options": the backend's options, "sharded": the actor ranks hold an
    # FSDP2-sharded model and each sends its shards, "delta": delta updates, and a third update a few elements from the
    # second's version (its report under "delta")}.
    placement: dict[str, Any] = (json.loads(sys.argv[3]) if len(sys.argv) > 3
                                 else {"actor_ranks": 1, "replicas": [["2", "3"]] * 2})
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    sharded = placement.get("sharded", False)
    actor_wg = RayActorWorkerGroup.create(world_size=placement["actor_ranks"], node_id=nodes["1"],
                                          source_factory=FsdpTpSource if sharded else functools.partial(
                                              ModelSource, numel=NUMEL))
    replicas = [RayRolloutReplica.create(replica=r, sink_factory=RecordingSink, num_workers=len(hosts),
                                         node_id=[nodes[host] for host in hosts])
                for r, hosts in enumerate(placement["replicas"])]
    delta = placement.get("delta", False)
    if sharded:  # the ranks' own gloo group, on their host (port 29500 + a little: the testbed's hosts are fresh)
        ray.get(actor_wg.call("join", "tcp://127.0.0.1:29611"))
        ray.get(actor_wg.call("set_version", 1))
    config = SyncConfig(bucket_bytes=placement.get("bucket_mb", 4) * MiB, staged=placement.get("staged", False),
                        backend_options=placement.get("options", {}), delta=delta,
                        timeouts=StepTimeouts(transfer=60, setup=60))
    manager = CheckpointEngineManager(backend=backend, actor_wg=actor_wg, replicas=replicas, config=config)
    result: dict[str, Any] = {"first": asyncio.run(manager.update_weights()).ok}
    second = NUDGED + 1 if delta else 3  # with delta: wholly unlike the first (every bucket dense), then nudged
    result["expected"] = ray.get(actor_wg.call("set_version", second))[0]
    channel.ask({"mark": "before"})
    report = asyncio.run(manager.update_weights())
    channel.ask({"mark": "after"})
    result.update(ok=report.ok, chosen=report.chosen, backend=report.backend, nbytes=report.nbytes,
                  swapped=[outcome.swap_seconds > 0 for outcome in report.replicas],
                  senders=len([sent for sent in report.transfers if sent.role == "actor" and sent.nbytes]),
                  digests=[digest for replica in replicas for digest in ray.get(replica.call("digest"))])
    if delta:
        expected = ray.get(actor_wg.call("set_version", second + 1))[0]
        nudged = asyncio.run(manager.update_weights())
        result["delta"] = dict(
            ok=nudged.ok, received=[outcome.received for outcome in nudged.replicas], expected=expected,
            wire=sum(sent.wire_bytes for sent in nudged.transfers if sent.role == "actor"),
            digests=[digest for replica in replicas for digest in ray.get(replica.call("digest"))])
    channel.tell({"result": result})
    for replica in replicas:
        replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
