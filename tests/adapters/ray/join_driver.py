"""The driver of test_across_hosts' join: a replica added to a running manager catches up from a peer.

Placement (hosts by index): the actor rank on host 1; replica 0 on host 2, replica 1 on host 3, each one worker
whose sink serves a probe request every ``PROBE_S`` while it is not paused (``ServingSink``). Delta updates of a
64 MiB model whose versions differ in about 1 % of their elements. After 3 updates a replica joins on host 3 and
``connect()`` catches it up: the peer is replica 0 (the first committed one), so its bytes cross from host 2, and
the actor rank's host sends none of them. The test marks every link's counters around the catch-up and around an
idle window as long; the driver reports each serving replica's probe gaps before and during the catch-up, what the
newcomer held when it was resumed, and the update after it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
import torch

from tests.tools.testbed.driving import DriverChannel
from tests.workloads import RecordingSink, weights_digest
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.cli.bench.soak_driver import TENSORS, model
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

NUMEL = 1024 * 1024  # float32, TENSORS of them: 64 MiB
PROBE_S = 0.05


class SparseSource:
    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        self.weights = model(0, numel=NUMEL)

    def set_version(self, version: int) -> str:
        self.weights = model(version, numel=NUMEL)
        return weights_digest(self.weights)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights


class ServingSink(RecordingSink):
    """A ``RecordingSink`` that serves a probe request (a read of its weights) every ``PROBE_S`` while not paused,
    recording when each was served; what it held when it was last resumed."""

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        self.paused = False
        self.served: list[float] = []
        self.resumed_holding = ""
        threading.Thread(target=self._serve, daemon=True, name="probe").start()

    def _serve(self) -> None:
        while True:
            if not self.paused and self.weights:
                float(next(iter(self.weights.values()))[:1024].sum())
                self.served.append(time.time())
            time.sleep(PROBE_S)

    def abort_all_requests(self) -> None:
        self.paused = True
        super().abort_all_requests()

    def resume_generation(self) -> None:
        self.resumed_holding = self.digest()
        self.paused = False
        super().resume_generation()

    def gaps(self, start: float, end: float) -> list[float]:
        times = [t for t in self.served if start <= t <= end]
        return [later - earlier for earlier, later in zip(times, times[1:])]

    def held_at_resume(self) -> str:
        return self.resumed_holding


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=SparseSource, node_id=nodes["1"])
    replicas = [RayRolloutReplica.create(replica=r, sink_factory=ServingSink, node_id=nodes[host])
                for r, host in ((0, "2"), (1, "3"))]
    config = SyncConfig(bucket_bytes=8 * 1024 * 1024, delta=True, timeouts=StepTimeouts(transfer=60, setup=60))
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=replicas, config=config)
    result: dict[str, Any] = {"model_bytes": TENSORS * NUMEL * 4}
    for version in (1, 2, 3):
        result["expected"] = ray.get(actor_wg.call("set_version", version))[0]
        assert asyncio.run(manager.update_weights(version=version)).ok
    newcomer = RayRolloutReplica.create(replica=2, sink_factory=ServingSink, node_id=nodes["3"])
    ray.get(newcomer.call("pid"))  # started: its start is not the catch-up's
    before = time.time()
    time.sleep(1.5)  # the serving replicas' gaps before it
    channel.ask({"mark": "catch_up0"})
    started = time.time()
    manager.add_replicas([newcomer])
    asyncio.run(manager.connect())
    ended = time.time()
    channel.ask({"mark": "catch_up1"})
    channel.ask({"mark": "idle0"})
    time.sleep(ended - started)
    channel.ask({"mark": "idle1"})
    result["catch_up_seconds"] = ended - started
    result["gaps"] = [{"before": ray.get(replica.call("gaps", before, started))[0],
                       "during": ray.get(replica.call("gaps", started, ended))[0]} for replica in replicas]
    result["status"] = [[state.state, state.version] for state in manager.status()]
    result["newcomer_at_resume"] = ray.get(newcomer.call("held_at_resume"))[0]
    result["expected_next"] = ray.get(actor_wg.call("set_version", 4))[0]
    report = asyncio.run(manager.update_weights(version=4))
    result["next"] = {"ok": report.ok, "received": [outcome.received for outcome in report.replicas],
                      "joined": [[outcome.replica, outcome.state] for outcome in report.joined],
                      "wire_bytes": report.wire_bytes, "changed": report.changed_fraction * report.nbytes,
                      "nbytes": report.nbytes}
    result["digests"] = [digest for replica in [*replicas, newcomer] for digest in ray.get(replica.call("digest"))]
    channel.tell({"result": result})
    for replica in [*replicas, newcomer]:
        replica.shutdown()
    actor_wg.shutdown()


if __name__ == "__main__":
    main()
