"""The driver of test_small_shm, run in a private mount namespace whose ``/dev/shm`` is a 64 MiB tmpfs (Docker's
default): every process it starts (Ray's, the workers) sees that ``/dev/shm`` and no other.

It starts a Ray cluster of its own, one actor rank and two one-worker replicas, and tries, in order:
1. the ``shm`` backend at the defaults (a ring of 4 × 64 MiB): the update must fail with ``SharedMemoryFullError``;
2. ``auto``: it must pick a layout that fits and update every replica (version 1);
3. ``auto`` staged, version 2 of a model larger than ``/dev/shm``: refused naming ``/dev/shm``, the replicas keep
   serving version 1.
After each it records what the manager said, whether every worker process is still alive (each answers its pid and
the kernel knows it) and which weightsync files ``/dev/shm`` holds. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from typing import Any

import ray

from tests.workloads import ModelSource, RecordingSink
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

MODEL_NUMEL = 1_600_000
"""12 tensors of 1.6 M elements (float32, bfloat16, int64 in turn): about 90 MB, more than the 64 MiB tmpfs."""


class LargeSource(ModelSource):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, numel=MODEL_NUMEL)


def alive(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
    return True


def ours_in_shm() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("weightsync-"))


def attempt(actor_wg: RayActorWorkerGroup, replicas: list[RayRolloutReplica], backend: str, *, version: int = 1,
            **options: Any) -> dict[str, Any]:
    config = SyncConfig(timeouts=StepTimeouts(setup=60, transfer=60), **options)
    manager = CheckpointEngineManager(actor_wg=actor_wg, replicas=replicas, config=config, backend=backend)
    started = time.monotonic()
    result: dict[str, Any] = {}
    try:
        report = asyncio.run(manager.update_weights(version=version))
        result.update(ok=report.ok, backend=report.backend, chosen=report.chosen)
    except Exception as exc:  # what the caller sees: its type and message, and its facts
        result.update(ok=False, error=type(exc).__name__, message=str(exc),
                      path=getattr(exc, "path", None), free=getattr(exc, "free", None))
    result["seconds"] = time.monotonic() - started
    result["states"] = [[state.state, state.resumed] for state in manager.status()]
    pids = [int(pid) for pid in ray.get(actor_wg.call("pid"))]
    pids += [int(ray.get(replica.call("pid")[0])) for replica in replicas]
    result["alive"] = alive(pids)
    result["digests"] = [str(ray.get(replica.call("digest")[0])) for replica in replicas]
    result["hooks"] = [list(ray.get(replica.call("hook_log")[0])) for replica in replicas]
    result["shm_after"] = ours_in_shm()
    return result


def main() -> None:
    ray_dir = tempfile.mkdtemp(prefix="wst-ray-")  # a cluster of its own: never the test run's
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False, _temp_dir=ray_dir)
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=LargeSource)
    replicas = [RayRolloutReplica.create(replica=index, sink_factory=RecordingSink) for index in range(2)]
    result: dict[str, Any] = {"v1": str(ray.get(actor_wg.call("set_version", 1))[0])}
    try:
        result["shm"] = attempt(actor_wg, replicas, "shm")
        result["auto"] = attempt(actor_wg, replicas, "auto")
        result["v2"] = str(ray.get(actor_wg.call("set_version", 2))[0])
        result["staged"] = attempt(actor_wg, replicas, "auto", version=2, staged=True)
    finally:
        for replica in replicas:
            replica.shutdown()
        actor_wg.shutdown()
        ray.shutdown()
        shutil.rmtree(ray_dir, ignore_errors=True)
    result["shm_end"] = ours_in_shm()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
