"""``weightsync bench --soak``'s driver, run inside the testbed's head host (``weightsync.cli.bench.soak`` starts it).

Placement: the actor rank on host 1; one-worker replicas on hosts 2 and 3, three to start with. One
``CheckpointEngineManager`` (``backend="auto"``, delta updates) runs ``updates`` updates. Every few updates (2 to 4,
drawn from ``seed``) one event strikes, drawn too: a replica's worker killed between updates, a replica's worker
killed mid-update (the stream slowed so the kill lands inside it), or a new replica added (``add_replicas``: it
catches up from a peer before the update). At most ``MAX_REPLICAS`` replicas, at least two.

After every update the driver checks, from outside the manager: the update did not raise; every replica the manager
keeps is committed at that version and every worker of it holds the version's bytes (hashed in its own process); no
replica left torn is serving (its own pause/resume hooks); each kill's replica was evicted by the update it struck
(before it, or during it); an added replica caught up from a peer. At the end every actor is shut down and the
cluster asked which actors are still alive. One JSON line per update on stdout, then ``{"result": ...}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import ray
import torch

from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.types import UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

TENSORS = 16
NUMEL = 256 * 1024  # float32: 1 MiB per tensor, 16 MiB in all
SLOW_S = 0.1
"""Per tensor, when an update is to be struck mid-way (1.6 s of streaming)."""
KILL_AFTER_S = 0.5
MAX_REPLICAS = 4
EVENTS = ("kill-between", "kill-mid", "add")


def model(version: int, *, numel: int = NUMEL) -> list[tuple[str, torch.Tensor]]:
    """Version ``version`` of the model (``TENSORS`` float32 tensors of ``numel``): a fixed random base, about 1 %
    of each tensor's elements moved by the version (so each update is a delta against the last)."""
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for index in range(TENSORS):
        tensor = torch.randn(numel, generator=generator)
        tensor[version % 97::97] += version * 1e-3
        tensors.append((f"layers.{index:02d}.weight", tensor))
    return tensors


def digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        hasher.update(name.encode())
        hasher.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()[:32]


class SoakSource:
    """The actor rank's model (a ``WeightSource``): ``model(version)``, slowed on request."""

    def __init__(self, rank: int, world_size: int) -> None:
        torch.set_num_threads(1)
        self.weights = model(0)
        self.delay = 0.0

    def set_version(self, version: int, delay: float) -> str:
        self.weights, self.delay = model(version), delay
        return digest(self.weights)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.weights:
            if self.delay:
                time.sleep(self.delay)
            yield item


class SoakSink:
    """A rollout worker's model (a ``WeightSink``): a copy of every tensor, and whether it serves."""

    def __init__(self, replica: int, worker: int) -> None:
        torch.set_num_threads(1)
        self.weights: dict[str, torch.Tensor] = {}
        self.serving = True

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        async for name, tensor in weights:
            self.weights[name] = tensor.clone()

    def digest(self) -> str:
        return digest(list(self.weights.items()))

    def is_serving(self) -> bool:
        return self.serving

    def abort_all_requests(self) -> None:
        self.serving = False

    def release_kv_cache(self) -> None:
        pass

    def resume_kv_cache(self) -> None:
        pass

    def resume_generation(self) -> None:
        self.serving = True


class Soak:
    """The run: the fleet, the events drawn from the seed, and every check after every update."""

    def __init__(self, nodes: dict[str, str], seed: int, max_evicted: int) -> None:
        self.nodes, self.random = nodes, random.Random(seed)
        self.actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=SoakSource, node_id=nodes["1"])
        self.made = 0
        self.replicas = [self.new_replica() for _ in range(3)]
        self.manager = CheckpointEngineManager(actor_wg=self.actor_wg, replicas=self.replicas, config=SyncConfig(
            bucket_bytes=4 * 1024 * 1024, delta=True, max_evicted=max_evicted,
            timeouts=StepTimeouts(transfer=20, setup=60)))
        self.problems: list[str] = []

    def new_replica(self) -> RayRolloutReplica:
        host = "2" if self.made % 2 == 0 else "3"
        self.made += 1
        return RayRolloutReplica.create(replica=self.made - 1, sink_factory=SoakSink, node_id=self.nodes[host])

    def event(self) -> str:
        allowed = [event for event in EVENTS if (len(self.replicas) < MAX_REPLICAS if event == "add"
                                                 else len(self.replicas) > 2)]
        return self.random.choice(allowed)

    async def update(self, version: int, event: str | None) -> dict[str, Any]:
        expected = (await asyncio.gather(*self.actor_wg.call("set_version", version,
                                                             SLOW_S if event == "kill-mid" else 0.0)))[0]
        victim: RayRolloutReplica | None = None
        if event == "add":
            newcomer = self.new_replica()
            self.manager.add_replicas([newcomer])
            self.replicas.append(newcomer)
        elif event is not None:
            victim = self.random.choice(self.replicas)
        if event == "kill-between" and victim is not None:
            ray.kill(victim.workers[0].handle)
        started = time.perf_counter()
        task = asyncio.create_task(self.manager.update_weights(version=version))
        if event == "kill-mid" and victim is not None:
            await asyncio.sleep(KILL_AFTER_S)
            ray.kill(victim.workers[0].handle)
        try:
            report: UpdateReport | None = await task
        except Exception as error:  # noqa: BLE001 - a soak records what went wrong and goes on
            report = None
            self.problems.append(f"update {version} ({event}) raised {type(error).__name__}: {error}")
        line = {"version": version, "event": event, "seconds": round(time.perf_counter() - started, 3)}
        if victim is not None:
            self.replicas.remove(victim)
        if report is not None:
            line.update(self.check(version, expected, report, victim, event == "add"))
        return line

    def check(self, version: int, expected: str, report: UpdateReport, victim: RayRolloutReplica | None,
              added: bool) -> dict[str, Any]:
        """The checks of one update that returned (module docstring); what the line reports of it."""
        kept = self.replicas
        if list(self.manager.replicas) != kept:
            self.problems.append(f"update {version}: the manager keeps {len(self.manager.replicas)} replicas, "
                                 f"{len(kept)} are alive")
        if victim is not None and len(report.evicted) != 1:
            self.problems.append(f"update {version}: {len(report.evicted)} replicas evicted, 1 killed")
        if added and [outcome.state for outcome in report.joined] != ["committed"]:
            self.problems.append(f"update {version}: the added replica did not catch up from a peer: "
                                 f"{[(outcome.state, outcome.error) for outcome in report.joined]}")
        for index, (replica, state) in enumerate(zip(kept, self.manager.status())):
            held = ray.get(replica.call("digest"))
            if state.state != "committed" or state.version != version or held != [expected] * len(held):
                self.problems.append(f"update {version}: replica {index} is {state.state} at {state.version}, "
                                     f"{sum(digest == expected for digest in held)} of {len(held)} workers exact")
            if state.state == "torn" and any(ray.get(replica.call("is_serving"))):
                self.problems.append(f"update {version}: replica {index} is torn and serving")
        return {"replicas": len(report.replicas), "evicted": [outcome.error for outcome in report.evicted],
                "received": sorted({outcome.received for outcome in report.replicas}),
                "retried": "retry_transfer" in report.stages, "joined": len(report.joined), "ok": report.ok}

    def shutdown(self) -> int:
        """End every actor; how many the cluster still says are alive."""
        for replica in self.replicas:
            replica.shutdown()
        self.actor_wg.shutdown()
        from ray._private.state import actors  # the GCS's table: the state API would need Ray's dashboard

        deadline = time.monotonic() + 30
        while True:
            alive = len(actors(actor_state_name="ALIVE"))
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


async def run(soak: Soak, updates: int, say: Any) -> None:
    next_event = 3
    for version in range(1, updates + 1):
        event = None
        if version >= next_event:
            event, next_event = soak.event(), version + soak.random.randint(2, 4)
        say(await soak.update(version, event))


def main() -> None:
    options = json.loads(sys.argv[1])
    out = os.fdopen(os.dup(1), "w")  # the result's channel; Ray and torch may print on fd 1, now stderr
    os.dup2(2, 1)

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    ray.init(logging_level="ERROR", log_to_driver=False)
    soak = Soak(options["nodes"], options["seed"], options["max_evicted"])
    try:
        asyncio.run(run(soak, options["updates"], say))
    finally:
        alive = soak.shutdown()
    say({"result": {"problems": soak.problems, "alive_actors": alive, "replicas": soak.made}})


if __name__ == "__main__":
    main()
