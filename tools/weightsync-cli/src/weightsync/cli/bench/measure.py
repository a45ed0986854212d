"""Timing one case: 1 sender + R receivers spawned (see ``worker``), connected, and whole updates timed after a
warm-up; in the ``bucketed`` processes also the two yardsticks (a raw gloo broadcast, this host's copy bandwidth)."""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import statistics
import time
from dataclasses import dataclass
from typing import Any

from weightsync.api.config import MiB
from weightsync.api.registry import load_engine_class
from weightsync.api.types import WorldMetadata
from weightsync.cli.bench.scenario import BASELINES, Case
from weightsync.cli.bench.worker import Layout, c10d, serve
from weightsync.cli.progress import Progress
from weightsync.core.engine import default_node_id

__all__ = ["COPY_TRIES", "RAW_TRIES", "BenchResult", "Yardsticks", "cores", "measure_case"]

COPY_BYTES = 256 * MiB
COPY_TRIES = 5
RAW_TRIES = 3


@dataclass(frozen=True)
class BenchResult:
    backend: str
    gbps_p50: float
    gbps_p90: float
    peak_extra_rss_mb: float
    seconds: list[float]


@dataclass
class Yardsticks:
    raw_gloo_seconds: float = math.inf
    copy_bandwidth: float = 0.0  # bytes copied per second by k processes together, Tensor.copy_
    engine_copy_bandwidth: float = 0.0  # the same with the engines' own copy (copy_stream) in 256 KiB pieces
    copiers: int = 0


class _Workers:
    """1 + R spawned workers of one case; ``all_do`` sends one command to each and waits for every reply."""

    def __init__(self, name: str, layout: Layout, bucket_bytes: int, receivers: int) -> None:
        self.name = name
        context = multiprocessing.get_context("spawn")
        self.store: Any = None
        common: dict[str, Any] = {"layout": layout, "bucket_bytes": bucket_bytes, "node_id": default_node_id()}
        if name in BASELINES:
            # The driver hosts the baselines' store, bound to the loopback interface only.
            self.store = c10d.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            common.update(kind=name, store_host="127.0.0.1", store_port=int(self.store.port),
                          group_size=1 + receivers, tag=secrets.token_hex(8))
        else:
            common.update(kind="engine", backend=name)
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.processes: list[Any] = []
        for group_rank in range(1 + receivers):
            role, rank = ("actor", 0) if group_rank == 0 else ("rollout", group_rank - 1)
            spec = {**common, "role": role, "rank": rank, "group_rank": group_rank}
            parent, child = context.Pipe()
            process = context.Process(target=serve, args=(child, spec), daemon=True)
            process.start()
            child.close()
            self.pipes.append(parent)
            self.processes.append(process)

    def all_do(self, commands: list[dict[str, Any]], pipes: list[multiprocessing.connection.Connection] | None = None
               ) -> list[Any]:
        targets = self.pipes if pipes is None else pipes
        for pipe, command in zip(targets, commands):
            pipe.send_bytes(json.dumps(command).encode())
        replies = []
        for index, pipe in enumerate(targets):
            try:
                replies.append(json.loads(pipe.recv_bytes()))
            except EOFError:
                raise RuntimeError(f"{self.name}: worker {index} died (see its traceback above)") from None
        return replies

    def each(self, op: str, **fields: Any) -> list[Any]:
        return self.all_do([{"op": op, **fields}] * len(self.pipes))

    def connect(self, receivers: int) -> None:
        if self.name in BASELINES:
            self.each("init")
            return
        metadata = self.each("prepare")
        topology = load_engine_class(self.name).build_topology(
            actor_wg_world_size=1, rollout_world_size=receivers,
            metadata=WorldMetadata(actor=metadata[:1], rollout=metadata[1:]),
        )
        epoch = secrets.token_hex(16)
        self.all_do([{"op": "init", "rank_args": {"epoch": epoch, **args}}
                     for args in [*topology.actor, *topology.rollout]])

    def close(self) -> None:
        try:
            self.each("close")
        except (RuntimeError, OSError):
            pass
        finally:
            for process in self.processes:
                process.join(10)
                if process.is_alive():
                    process.kill()


def measure_case(case: Case, progress: Progress, trace: list[dict[str, Any]] | None = None,
                 yardsticks: Yardsticks | None = None) -> BenchResult:
    """Time ``case.repeat`` updates after a warm-up; with ``trace``, add one traced update's events to it; with
    ``yardsticks``, measure them in the same processes afterwards."""
    workers = _Workers(case.name, case.layout, case.bucket_bytes, case.receivers)
    try:
        workers.connect(case.receivers)
        workers.each("mark")
        workers.each("run")
        progress.step(f"{case.name}: warm-up")
        seconds = []
        for index in range(case.repeat):
            started = time.perf_counter()
            workers.each("run")
            seconds.append(time.perf_counter() - started)
            progress.step(f"{case.name}: update {index + 1}/{case.repeat}")
        # Taken before any yardstick allocates: the peak over the updates only.
        peak_extra = max(workers.each("rss")) / MiB
        if trace is not None:
            _trace_update(workers, case, progress, trace)
        if yardsticks is not None:
            _measure_yardsticks(workers, case, progress, yardsticks)
    finally:
        workers.close()
    rates = sorted(case.total_bytes / s / 1e9 for s in seconds)
    p90 = rates[max(0, round(0.1 * (len(rates) - 1)))]  # 90% of the updates were at least this fast
    return BenchResult(backend=case.name, gbps_p50=statistics.median(rates), gbps_p90=p90,
                       peak_extra_rss_mb=peak_extra, seconds=seconds)


def _trace_update(workers: _Workers, case: Case, progress: Progress, trace: list[dict[str, Any]]) -> None:
    started = time.perf_counter()
    for events in workers.each("trace"):
        trace.extend(events)
    trace.append({"name": f"update ({case.name})", "cat": "update", "ph": "X", "ts": started * 1e6,
                  "dur": (time.perf_counter() - started) * 1e6, "pid": "driver", "tid": "main"})
    progress.step(f"{case.name}: traced update")


def _measure_yardsticks(workers: _Workers, case: Case, progress: Progress, yardsticks: Yardsticks) -> None:
    workers.each("raw_setup", nbytes=case.total_bytes)
    workers.each("raw")  # warm-up: gloo's first broadcast of a new size sets up its pairs' buffers
    for _ in range(RAW_TRIES):
        started = time.perf_counter()
        workers.each("raw")
        yardsticks.raw_gloo_seconds = min(yardsticks.raw_gloo_seconds, time.perf_counter() - started)
        progress.step("raw gloo broadcast")
    # The copy bandwidth: k processes copy at once; the span runs from the first start to the last end, so start
    # skew only makes the figure smaller (a conservative, i.e. generous, limit is never the result).
    copiers = min(cores(), 1 + case.receivers)
    pipes = workers.pipes[:copiers]
    workers.all_do([{"op": "copy_setup", "nbytes": COPY_BYTES}] * copiers, pipes)
    times = 2
    workers.all_do([{"op": "copy", "times": 1}] * copiers, pipes)  # warm-up
    for _ in range(COPY_TRIES):
        for method in ("tensor", "engine"):
            spans = workers.all_do([{"op": "copy", "times": times, "method": method}] * copiers, pipes)
            elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
            bandwidth = copiers * times * COPY_BYTES / elapsed
            if method == "tensor":
                yardsticks.copy_bandwidth = max(yardsticks.copy_bandwidth, bandwidth)
            else:
                yardsticks.engine_copy_bandwidth = max(yardsticks.engine_copy_bandwidth, bandwidth)
        progress.step(f"copy bandwidth, k={copiers}")
    yardsticks.copiers = copiers


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
