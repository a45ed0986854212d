"""``weightsync bench --rollout vllm``: weightsync (shm) against the route a user without a transport takes (disk),
into the same real vLLM replicas, alternating.

- ``shm``: ``CheckpointEngineManager.update_weights`` — every replica paused, the update streamed into vLLM's
  loader through weightsync, vLLM's checksums compared across replicas, every replica resumed.
- ``disk``: rank 0 writes the version with safetensors into a directory on the machine's disk (not ``/dev/shm``; no
  fsync, no cache drop), then every replica is paused, runs vLLM's ``reload_weights(weights_path=...)`` and is
  resumed, all replicas at once.

Each update is timed from "the actor worker group holds version v" (a new version is made before the clock starts:
every weight moved by noise, the same on every rank) to "every replica resumed", the write included. Measured in
the replicas (``VllmEngineActor.timings``): ``pause_ms`` (pause call to the end of the resume) and ``load_ms``
(vLLM's own load: its loader's time less its waits for the next tensor, weightsync's receive or the checkpoint
iterator's read, which the disk row reports as ``read_ms``). Per row, ``transfer_ms``: the manager's transfer stage
(shm) or write + read (disk). After the rounds both routes load one more version each and their vLLM checksums are
compared (``routes_agree``).

With ``--tp N`` (N > 1) every engine runs N workers and the routes are two ways of feeding them over shm, into
replicas of their own (half of ``--receivers`` each), one update each in turn, the manager's membership switched
(and its epoch built) between them, outside the clock:

- ``parts``: each worker declared its part (``weightsync.vllm.parts``) and reads and hashes only that;
- ``whole``: each worker receives, reads and hashes the whole model (``VllmRolloutReplica.create(parts=False)``);
  vLLM's loaders take their slices from it.

Per worker, ``stream_cpu_ms``: the CPU time of the worker's thread that runs weightsync's side of the update
(``VllmEngineActor.timings``: taking buckets, handing vLLM its views, hashing); vLLM's loader runs in another.
``worker_read_bytes``: what the worker that read the most read and hashed of an update (its transfer report). The
summary gives each worker's ratio parts / whole, and the ratio of the pauses outside vLLM's load. After the rounds
one update goes to every replica at once: the manager's proof of load compares the two kinds of replica, and their
vLLM checksums are compared (``routes_agree``).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from weightsync.cli.vllm import VllmBenchOptions
from weightsync.cli.vllm.serving import Serving, serving
from weightsync.cli.vllm.workload import llama_config

__all__ = ["filesystem_of", "run_vllm_bench"]

MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs"}


def filesystem_of(path: str) -> str:
    """The type of the filesystem ``path`` lies on (the longest mount point above it in ``/proc/mounts``)."""
    resolved = str(pathlib.Path(path).resolve())
    best, kind = "", "unknown"
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fields[2]
    return kind


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


STREAM_CPU_BAR = 0.6
"""``--tp``: each worker's stream CPU by part, at most this fraction of the same with whole-model delivery."""
OUTSIDE_LOAD_BAR = 1.0
"""``--tp``: the pause outside vLLM's load by part, at most this fraction of whole-model delivery's."""
STREAM_CPU = "stream_cpu_seconds."


class _Routes:
    """The routes over one set of replicas; each ``run_*`` makes version ``v`` first and records a sample per
    replica it updated."""

    def __init__(self, world: Serving, manager: Any, disk: pathlib.Path) -> None:
        self.world = world
        self.manager = manager
        self.disk = disk
        self.version = 0
        self.samples: dict[str, list[dict[str, float]]] = {}

    async def _next_version(self) -> int:
        self.version += 1
        await asyncio.gather(*self.world.actor_wg.call("perturb", None, 0.01, self.version))
        await asyncio.gather(*self.world.actor_wg.call("hold"))
        return self.version

    async def _timings(self, replicas: list[Any]) -> list[dict[str, float]]:
        return list(await asyncio.gather(*(replica.call("timings") for replica in replicas)))

    async def _members(self, replicas: list[Any]) -> None:
        """Make ``replicas`` the manager's and build their epoch now, outside any clock."""
        if list(self.manager.replicas) != replicas:
            self.manager.remove_replicas(list(self.manager.replicas))
            self.manager.add_replicas(replicas)
        await self.manager.connect()

    async def run_shm(self, *, route: str = "shm", replicas: list[Any] | None = None, record: bool = True) -> None:
        replicas = list(self.world.replicas) if replicas is None else replicas
        await self._members(replicas)
        await self._next_version()
        began = time.perf_counter()
        report = await self.manager.update_weights()
        total = time.perf_counter() - began
        if not report.ok:
            raise RuntimeError(f"the {route} update failed: {report}")
        for timings in await self._timings(replicas) if record else ():
            sample = {"end_to_end": total, "pause": timings["pause_seconds"], "load": timings["load_seconds"],
                      "transfer": report.transfer_seconds, "read_bytes": max(
                          transfer.part_bytes if transfer.part >= 0 else transfer.nbytes
                          for transfer in report.transfers if transfer.role == "rollout")}
            sample.update({f"stream_cpu_{key[len(STREAM_CPU):]}": value for key, value in timings.items()
                           if key.startswith(STREAM_CPU)})
            self.samples.setdefault(route, []).append(sample)

    async def run_disk(self, *, record: bool = True) -> None:
        version = await self._next_version()
        path = self.disk / f"v{version}"
        began = time.perf_counter()
        write = await self.world.actor_wg.handles[0].call.remote("timed_save", str(path))
        replicas = self.world.replicas
        await asyncio.gather(*(replica.pause() for replica in replicas))
        await asyncio.gather(*(replica.call("reload", str(path)) for replica in replicas))
        await asyncio.gather(*(replica.resume() for replica in replicas))
        total = time.perf_counter() - began
        shutil.rmtree(path, ignore_errors=True)
        for timings in await self._timings(replicas) if record else ():
            self.samples.setdefault("disk", []).append({
                "end_to_end": total, "pause": timings["pause_seconds"], "load": timings["load_seconds"],
                "write": write, "read": timings["read_seconds"], "transfer": write + timings["read_seconds"]})

    async def routes_agree(self) -> bool:
        """One more version over each route: do the replicas' vLLM checksums agree with each other and across routes?"""
        await self.run_shm(record=False)
        by_shm = [await replica.vllm_checksums() for replica in self.world.replicas]
        version = self.version
        path = self.disk / f"v{version}"
        await self.world.actor_wg.handles[0].call.remote("save", str(path))  # the same version, from the disk
        await asyncio.gather(*(replica.call("reload", str(path)) for replica in self.world.replicas))
        shutil.rmtree(path, ignore_errors=True)
        by_disk = [await replica.vllm_checksums() for replica in self.world.replicas]
        return all(checksums == by_shm[0] for checksums in by_shm + by_disk)

    async def kinds_agree(self) -> bool:
        """``--tp``: one more version into every replica at once (the manager's proof of load compares the replicas
        fed by part with those fed whole): do their vLLM checksums agree?"""
        await self.run_shm(record=False)
        sums = [await replica.vllm_checksums() for replica in self.world.replicas]
        return all(checksums == sums[0] for checksums in sums)


def _row(route: str, samples: list[dict[str, float]]) -> dict[str, Any]:
    keys = ["end_to_end", "pause", "transfer", "load"] + (["write", "read"] if route == "disk" else [])
    keys += sorted({key for sample in samples for key in sample if key.startswith("stream_cpu_")})
    row: dict[str, Any] = {"backend": route}
    row.update({f"{key}_ms_p50": round(1000 * _p50([s[key] for s in samples]), 1) for key in keys})
    if route != "disk":  # what the worker that read the most read and hashed of an update
        row["worker_read_bytes"] = int(max(sample["read_bytes"] for sample in samples))
    row["outside_load_ms_p50"] = round(1000 * _p50([s["pause"] - s["load"] for s in samples]), 1)
    row["samples"] = len(samples)
    return row


async def run_vllm_bench(options: VllmBenchOptions) -> int:
    from weightsync.api.config import MiB, SyncConfig
    from weightsync.core.control.manager import CheckpointEngineManager

    kind = filesystem_of(options.disk_dir)
    if kind in MEMORY_FILESYSTEMS and options.tp == 1:
        print(f"weightsync bench: --disk-dir {options.disk_dir} is on {kind}, which is memory, not a disk",
              file=sys.stderr)
        return 2
    config = llama_config(options.model_mb, hidden=options.hidden)
    started = time.perf_counter()
    disk = pathlib.Path(tempfile.mkdtemp(prefix="weightsync-bench-vllm-", dir=options.disk_dir))
    by_part = options.replicas // 2 if options.tp > 1 else options.replicas
    try:
        async with serving(config=config, root=disk, replicas=options.replicas, tensor_parallel_size=options.tp,
                           whole=options.replicas - by_part) as world:
            model_bytes = int(await world.actor_wg.handles[0].call.remote("nbytes"))
            routes_text = (f"by part and whole ({by_part} replicas each)" if options.tp > 1
                           else f"shm and disk ({options.disk_dir}, {kind})")
            print(f"weightsync bench --rollout vllm: Llama of {config['num_hidden_layers']} layers of hidden "
                  f"{config['hidden_size']} "
                  f"({model_bytes / 1e6:.0f} MB bf16), {options.replicas} vLLM replicas of {options.tp} worker(s), "
                  f"{options.repeat} rounds of {routes_text}", flush=True)
            manager = CheckpointEngineManager(backend="shm", actor_wg=world.actor_wg, replicas=world.replicas,
                                              config=SyncConfig(bucket_bytes=options.bucket_mb * MiB))
            routes = _Routes(world, manager, disk)
            for round_ in range(options.repeat + 1):  # the first round warms both routes up
                if options.tp > 1:
                    await routes.run_shm(route="parts", replicas=world.replicas[:by_part], record=round_ > 0)
                    await routes.run_shm(route="whole", replicas=world.replicas[by_part:], record=round_ > 0)
                else:
                    await routes.run_shm(record=round_ > 0)
                    await routes.run_disk(record=round_ > 0)
            agree = await (routes.kinds_agree() if options.tp > 1 else routes.routes_agree())
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    rows = [_row(route, samples) for route, samples in routes.samples.items()]
    result = _summary(rows, options=options, model_bytes=model_bytes, layers=config["num_hidden_layers"],
                      filesystem=kind, routes_agree=agree, wall_seconds=time.perf_counter() - started)
    _print(result)
    if options.json_path:
        pathlib.Path(options.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if agree else 1


def _summary(rows: list[dict[str, Any]], *, options: VllmBenchOptions, model_bytes: int, layers: int,
             filesystem: str, routes_agree: bool, wall_seconds: float) -> dict[str, Any]:
    import vllm

    result: dict[str, Any] = {
        "rollout": "vllm", "vllm": str(vllm.__version__), "model_bytes": model_bytes, "layers": layers,
        "replicas": options.replicas, "tensor_parallel_size": options.tp, "rounds": options.repeat,
        "bucket_mb": options.bucket_mb, "rows": rows, "routes_agree": routes_agree,
        "wall_seconds": round(wall_seconds, 1),
    }
    if options.tp > 1:
        parts, whole = rows
        result["ratio_stream_cpu"] = {
            key[len("stream_cpu_"):-len("_ms_p50")]: round(parts[key] / max(whole[key], 1e-9), 3)
            for key in parts if key.startswith("stream_cpu_")}
        result["ratio_outside_load"] = round(parts["outside_load_ms_p50"] / max(whole["outside_load_ms_p50"], 1e-9),
                                             3)
        result["meets"] = (all(ratio <= STREAM_CPU_BAR for ratio in result["ratio_stream_cpu"].values())
                           and result["ratio_outside_load"] <= OUTSIDE_LOAD_BAR)
        return result
    shm, disk = rows
    result.update({
        "disk_dir_filesystem": filesystem,
        "speedup_end_to_end": round(disk["end_to_end_ms_p50"] / max(shm["end_to_end_ms_p50"], 1e-9), 2),
        "shm_outside_load_over_disk_io": round(shm["outside_load_ms_p50"] / max(disk["transfer_ms_p50"], 1e-9), 3),
    })
    return result


def _print(result: dict[str, Any]) -> None:
    columns = ["end_to_end", "pause", "transfer", "load", "outside_load"]
    columns += ([f"stream_cpu_worker{index}" for index in range(result["tensor_parallel_size"])]
                if result["tensor_parallel_size"] > 1 else ["write", "read"])
    print(f"{'route':<6}" + "".join(f"{name.replace('stream_cpu_worker', 'stream_cpu_w') + '_ms':>17}"
                                     for name in columns))
    for row in result["rows"]:
        cells = [row.get(f"{name}_ms_p50") for name in columns]
        print(f"{row['backend']:<6}" + "".join(f"{'' if cell is None else cell:>17}" for cell in cells))
    agree = "yes" if result["routes_agree"] else "NO"
    if result["tensor_parallel_size"] > 1:
        ratios = ", ".join(f"{worker} {ratio:.3f}" for worker, ratio in result["ratio_stream_cpu"].items())
        parts, whole = result["rows"]
        print(f"each worker read and hashed {parts['worker_read_bytes'] / 1e6:.1f} MB of an update by part, "
              f"{whole['worker_read_bytes'] / 1e6:.1f} MB whole")
        print(f"by part / whole: stream CPU per worker {ratios} x (bar {STREAM_CPU_BAR:g}); pause outside vLLM's "
              f"load {result['ratio_outside_load']:.3f} x (bar {OUTSIDE_LOAD_BAR:g}): "
              f"{'meets' if result['meets'] else 'MISSES'}; both kinds of replica load identical weights: {agree} "
              f"({result['wall_seconds']:.0f} s in all)")
        return
    print(f"shm is {result['speedup_end_to_end']:.2f} x faster end to end than disk; its pause outside vLLM's load "
          f"is {result['shm_outside_load_over_disk_io']:.3f} x disk's write + read; both routes load identical "
          f"weights: {agree} ({result['wall_seconds']:.0f} s in all)")
