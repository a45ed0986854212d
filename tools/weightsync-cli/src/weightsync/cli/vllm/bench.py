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


class _Routes:
    """The two routes over one set of replicas; each ``run_*`` makes version ``v`` first and records a sample."""

    def __init__(self, world: Serving, manager: Any, disk: pathlib.Path) -> None:
        self.world = world
        self.manager = manager
        self.disk = disk
        self.version = 0
        self.samples: dict[str, list[dict[str, float]]] = {"shm": [], "disk": []}

    async def _next_version(self) -> int:
        self.version += 1
        await asyncio.gather(*self.world.actor_wg.call("perturb", None, 0.01, self.version))
        await asyncio.gather(*self.world.actor_wg.call("hold"))
        return self.version

    async def _timings(self) -> list[dict[str, float]]:
        return list(await asyncio.gather(*(replica.call("timings") for replica in self.world.replicas)))

    async def run_shm(self, *, record: bool = True) -> None:
        await self._next_version()
        began = time.perf_counter()
        report = await self.manager.update_weights()
        total = time.perf_counter() - began
        if not report.ok:
            raise RuntimeError(f"the shm update failed: {report}")
        for timings in await self._timings() if record else ():
            self.samples["shm"].append({"end_to_end": total, "pause": timings["pause_seconds"],
                                        "load": timings["load_seconds"], "transfer": report.transfer_seconds})

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
        for timings in await self._timings() if record else ():
            self.samples["disk"].append({"end_to_end": total, "pause": timings["pause_seconds"],
                                         "load": timings["load_seconds"], "write": write,
                                         "read": timings["read_seconds"],
                                         "transfer": write + timings["read_seconds"]})

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


def _row(route: str, samples: list[dict[str, float]]) -> dict[str, Any]:
    keys = ["end_to_end", "pause", "transfer", "load"] + (["write", "read"] if route == "disk" else [])
    row: dict[str, Any] = {"backend": route}
    row.update({f"{key}_ms_p50": round(1000 * _p50([s[key] for s in samples]), 1) for key in keys})
    row["outside_load_ms_p50"] = round(1000 * _p50([s["pause"] - s["load"] for s in samples]), 1)
    row["samples"] = len(samples)
    return row


async def run_vllm_bench(options: VllmBenchOptions) -> int:
    from weightsync.api.config import MiB, SyncConfig
    from weightsync.core.control.manager import CheckpointEngineManager

    kind = filesystem_of(options.disk_dir)
    if kind in MEMORY_FILESYSTEMS:
        print(f"weightsync bench: --disk-dir {options.disk_dir} is on {kind}, which is memory, not a disk",
              file=sys.stderr)
        return 2
    config = llama_config(options.model_mb)
    started = time.perf_counter()
    disk = pathlib.Path(tempfile.mkdtemp(prefix="weightsync-bench-vllm-", dir=options.disk_dir))
    try:
        async with serving(config=config, root=disk, replicas=options.replicas) as world:
            model_bytes = int(await world.actor_wg.handles[0].call.remote("nbytes"))
            print(f"weightsync bench --rollout vllm: Llama of {config['num_hidden_layers']} layers "
                  f"({model_bytes / 1e6:.0f} MB bf16), {options.replicas} vLLM replicas, {options.repeat} rounds "
                  f"of shm and disk ({options.disk_dir}, {kind})", flush=True)
            manager = CheckpointEngineManager(backend="shm", actor_wg=world.actor_wg, replicas=world.replicas,
                                              config=SyncConfig(bucket_bytes=options.bucket_mb * MiB))
            routes = _Routes(world, manager, disk)
            for round_ in range(options.repeat + 1):  # the first round warms both routes up
                await routes.run_shm(record=round_ > 0)
                await routes.run_disk(record=round_ > 0)
            agree = await routes.routes_agree()
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

    shm, disk = rows
    return {
        "rollout": "vllm", "vllm": str(vllm.__version__), "model_bytes": model_bytes, "layers": layers,
        "replicas": options.replicas, "rounds": options.repeat, "bucket_mb": options.bucket_mb,
        "disk_dir_filesystem": filesystem, "rows": rows,
        "speedup_end_to_end": round(disk["end_to_end_ms_p50"] / max(shm["end_to_end_ms_p50"], 1e-9), 2),
        "shm_outside_load_over_disk_io": round(shm["outside_load_ms_p50"] / max(disk["transfer_ms_p50"], 1e-9), 3),
        "routes_agree": routes_agree, "wall_seconds": round(wall_seconds, 1),
    }


def _print(result: dict[str, Any]) -> None:
    columns = ["end_to_end", "pause", "transfer", "load", "outside_load", "write", "read"]
    print(f"{'route':<6}" + "".join(f"{name + '_ms':>17}" for name in columns))
    for row in result["rows"]:
        cells = [row.get(f"{name}_ms_p50") for name in columns]
        print(f"{row['backend']:<6}" + "".join(f"{'' if cell is None else cell:>17}" for cell in cells))
    print(f"shm is {result['speedup_end_to_end']:.2f} x faster end to end than disk; its pause outside vLLM's load "
          f"is {result['shm_outside_load_over_disk_io']:.3f} x disk's write + read; both routes load identical "
          f"weights: {'yes' if result['routes_agree'] else 'NO'} ({result['wall_seconds']:.0f} s in all)")
