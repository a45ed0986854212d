"""The driver of ``weightsync bench``: it spawns 1 sender + R receivers per measured case and times whole updates.

An update's time runs from the driver's "go" to the last worker's "done", after one warm-up update; figures are GB/s
per receiver (S / time, decimal GB). Every figure of one run is measured side by side on the same machine, so the
ratios are what to compare: this host is shared and noisy.

The yardsticks, measured in the same run:
- ``naive`` and ``bucketed``: gloo baselines (see ``worker``) in the same process layout as the backends;
- raw gloo: one broadcast of the model's S bytes between pre-faulted buffers, in the ``bucketed`` processes;
- ``limit``: each byte is packed once and unpacked once per receiver, so an update copies S·(1+R) bytes, and at
  best k = min(cores, 1+R) processes copy at once: t_min = S·(1+R) / BW(k), BW(k) being the aggregate copy
  bandwidth of k processes copying between pre-faulted buffers (best of several tries). Per receiver that is
  S / t_min = BW(k) / (1+R).

Also measured, unless ``--no-ray`` (see ``ray_e2e``): ``CheckpointEngineManager.update_weights`` of a 1 MiB model
through the Ray adapter, pause → resume included, against one no-op call gathered from every worker (target: at
most 5 ×). The JSON's ``ray_end_to_end`` holds those figures, or ``{"skipped": reason}``.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from weightsync.api.config import MiB
from weightsync.api.registry import available_backends, load_engine_class
from weightsync.api.types import WorldMetadata
from weightsync.cli.bench.ray_e2e import E2E_TARGET, RayEndToEnd, measure_ray_end_to_end, ray_unavailable
from weightsync.cli.bench.worker import Layout, serve
from weightsync.core.engine import default_node_id
from weightsync.core.tensors import STREAM_COPY

__all__ = ["BenchOptions", "BenchResult", "model_layout", "run_bench"]

c10d: Any = dist

BASELINES = ("naive", "bucketed")
SMALL_TENSOR_BYTES = 4096
SMALL_DEFAULT_TENSORS = 10_000
COPY_BYTES = 256 * MiB
COPY_TRIES = 5
RAW_TRIES = 3
RAY_WARMUP = 3
RAY_REPEAT = 20
RAY_ACTOR_RANKS = 2


@dataclass(frozen=True)
class BenchOptions:
    backends: tuple[str, ...] = ()
    model_mb: float | None = None
    """None: 1024 MiB for ``realistic``, 10,000 tensors of 4 KiB (39 MiB) for ``small``."""
    receivers: int = 2
    bucket_mb: int = 64
    mix: str = "realistic"
    repeat: int = 5
    json_path: str | None = None
    plot_path: str | None = None
    trace_path: str | None = None
    ray: bool = True
    """Also measure the Ray end-to-end update against a gathered no-op (``--no-ray`` turns it off)."""
    ray_backend: str | None = None
    """Backend of the Ray end-to-end update; None: shm where it can run, else the first measured backend."""


@dataclass(frozen=True)
class BenchResult:
    backend: str
    gbps_p50: float
    gbps_p90: float
    peak_extra_rss_mb: float
    seconds: list[float]


def model_bytes(options: BenchOptions) -> int:
    if options.model_mb is not None:
        return int(options.model_mb * MiB)
    return SMALL_DEFAULT_TENSORS * SMALL_TENSOR_BYTES if options.mix == "small" else 1024 * MiB


def model_layout(total_bytes: int, bucket_bytes: int, mix: str) -> Layout:
    """Names and bf16 shapes adding up to about ``total_bytes``."""
    if mix == "small":
        count = max(1, total_bytes // SMALL_TENSOR_BYTES)
        return [(f"layers.{i}.bias", (SMALL_TENSOR_BYTES // 2,)) for i in range(count)]
    elements = total_bytes // 2
    # One tensor larger than a bucket (split across buckets), many small vectors, large matrices for the rest.
    shapes: Layout = [("lm_head.weight", (min(elements, int(1.5 * bucket_bytes) // 2),))]
    remaining = elements - shapes[0][1][0]
    for i in range(200):
        if remaining < 2048:
            break
        shapes.append((f"model.layers.{i}.input_layernorm.weight", (2048,)))
        remaining -= 2048
    layer = 0
    while remaining > 0:
        numel = min(remaining, 4096 * 4096)
        shapes.append((f"model.layers.{layer}.mlp.up_proj.weight", (numel,)))
        remaining -= numel
        layer += 1
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


class Progress:
    """One bar on stderr for the whole run: every warm-up, timed update and yardstick try is a step."""

    def __init__(self, total: int) -> None:
        self.total = max(1, total)
        self.done = 0
        self.started = time.perf_counter()

    def step(self, label: str, count: int = 1) -> None:
        self.done = min(self.total, self.done + count)
        width = 30
        filled = width * self.done // self.total
        elapsed = time.perf_counter() - self.started
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{elapsed:5.0f}s  {label:<32.32}")
        sys.stderr.flush()

    def finish(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


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


@dataclass
class _Yardsticks:
    raw_gloo_seconds: float = math.inf
    copy_bandwidth: float = 0.0  # bytes copied per second by k processes together, Tensor.copy_
    engine_copy_bandwidth: float = 0.0  # the same with the engines' own copy (copy_stream) in 256 KiB pieces
    copiers: int = 0


@dataclass
class _Case:
    name: str
    total_bytes: int
    layout: Layout
    bucket_bytes: int
    receivers: int
    repeat: int


def _measure(case: _Case, progress: Progress, trace: list[dict[str, Any]] | None = None,
             yardsticks: _Yardsticks | None = None) -> BenchResult:
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
            started = time.perf_counter()
            for events in workers.each("trace"):
                trace.extend(events)
            trace.append({"name": f"update ({case.name})", "cat": "update", "ph": "X", "ts": started * 1e6,
                          "dur": (time.perf_counter() - started) * 1e6, "pid": "driver", "tid": "main"})
            progress.step(f"{case.name}: traced update")
        if yardsticks is not None:
            _measure_yardsticks(workers, case, progress, yardsticks)
    finally:
        workers.close()
    rates = sorted(case.total_bytes / s / 1e9 for s in seconds)
    p90 = rates[max(0, round(0.1 * (len(rates) - 1)))]  # 90% of the updates were at least this fast
    return BenchResult(backend=case.name, gbps_p50=statistics.median(rates), gbps_p90=p90,
                       peak_extra_rss_mb=peak_extra, seconds=seconds)


def _measure_yardsticks(workers: _Workers, case: _Case, progress: Progress, yardsticks: _Yardsticks) -> None:
    workers.each("raw_setup", nbytes=case.total_bytes)
    workers.each("raw")  # warm-up: gloo's first broadcast of a new size sets up its pairs' buffers
    for _ in range(RAW_TRIES):
        started = time.perf_counter()
        workers.each("raw")
        yardsticks.raw_gloo_seconds = min(yardsticks.raw_gloo_seconds, time.perf_counter() - started)
        progress.step("raw gloo broadcast")
    # The copy bandwidth: k processes copy at once; the span runs from the first start to the last end, so start
    # skew only makes the figure smaller (a conservative, i.e. generous, limit is never the result).
    copiers = min(_cores(), 1 + case.receivers)
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


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _case(name: str, options: BenchOptions, receivers: int | None = None, bucket_mb: int | None = None,
          total_bytes: int | None = None, repeat: int | None = None) -> _Case:
    bucket_bytes = (bucket_mb or options.bucket_mb) * MiB
    layout = model_layout(total_bytes or model_bytes(options), bucket_bytes, options.mix)
    return _Case(name=name, total_bytes=sum(2 * _numel(shape) for _, shape in layout), layout=layout,
                 bucket_bytes=bucket_bytes, receivers=receivers or options.receivers, repeat=repeat or options.repeat)


def _chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Numeric pid/tid with name metadata: Chrome's and Perfetto's JSON importers expect integers there."""
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    for event in sorted(events, key=lambda event: float(event["ts"])):
        pid_name, tid_name = str(event["pid"]), str(event["tid"])
        if pid_name not in pids:
            pids[pid_name] = len(pids) + 1
            out.append({"name": "process_name", "ph": "M", "pid": pids[pid_name], "args": {"name": pid_name}})
        if (pid_name, tid_name) not in tids:
            tids[pid_name, tid_name] = len(tids) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": pids[pid_name], "tid": tids[pid_name, tid_name],
                        "args": {"name": tid_name}})
        out.append({**event, "pid": pids[pid_name], "tid": tids[pid_name, tid_name]})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def run_bench(options: BenchOptions) -> int:
    wall_started = time.perf_counter()
    backends = options.backends or tuple(available_backends())
    for backend in backends:
        if backend in BASELINES:
            print(f"weightsync bench: {backend!r} is a baseline and always runs; do not list it", file=sys.stderr)
            return 2
        load_engine_class(backend)  # an unknown or uninstalled backend fails here, naming what to install
    ray_skipped = ray_unavailable() if options.ray else "--no-ray"
    ray_backend = options.ray_backend or ""
    if ray_skipped is None:
        if not ray_backend:
            ray_backend = "shm" if "shm" in available_backends() else backends[0]
        load_engine_class(ray_backend)
    plotting = None
    if options.plot_path:
        try:
            import matplotlib  # noqa: F401  (checked first: a missing extra should not cost a whole run)
        except ImportError:
            print("weightsync bench --plot needs matplotlib: pip install matplotlib "
                  "(or pip install 'weightsync-cli[plot]')", file=sys.stderr)
            return 2
        plotting = _sweep_cases(options, backends)
    names = [*backends, *BASELINES]
    steps = len(names) * (1 + options.repeat) + RAW_TRIES + COPY_TRIES + (1 if options.trace_path else 0)
    if ray_skipped is None:
        steps += RAY_WARMUP + RAY_REPEAT
    if plotting is not None:
        steps += sum(1 + case.repeat for case in {(case.name, case.bucket_bytes, case.receivers): case
                                                  for _, case in plotting}.values())
    progress = Progress(steps)
    yardsticks = _Yardsticks()
    trace: list[dict[str, Any]] = []
    results: dict[str, BenchResult] = {}
    for index, name in enumerate(names):
        case = _case(name, options)
        results[name] = _measure(case, progress, trace=trace if options.trace_path and index == 0 else None,
                                 yardsticks=yardsticks if name == "bucketed" else None)
    ray_e2e: RayEndToEnd | None = None
    ray_failed = False
    if ray_skipped is None:
        progress.step(f"ray e2e: starting Ray ({ray_backend})", count=0)
        try:
            ray_e2e = measure_ray_end_to_end(
                backend=ray_backend, workers=RAY_ACTOR_RANKS, replicas=options.receivers, repeat=RAY_REPEAT,
                warmup=RAY_WARMUP, bucket_bytes=options.bucket_mb * MiB, step=progress.step,
            )
        except Exception as exc:  # noqa: BLE001 - the table is measured already: report the failure, keep it
            ray_skipped = f"failed: {type(exc).__name__}: {exc}"
            ray_failed = True
    sweep: list[tuple[str, str, float, float]] = []  # (axis, backend, x, GB/s p50)
    if plotting is not None:
        measured: dict[tuple[str, int, int], float] = {}  # the point (B, R) sits on both axes: measured once
        for axis, case in plotting:
            key = (case.name, case.bucket_bytes, case.receivers)
            if key not in measured:
                measured[key] = _measure(case, progress).gbps_p50
            sweep.append((axis, case.name, case.bucket_bytes / MiB if axis == "bucket" else case.receivers,
                          measured[key]))
    progress.finish()

    main = _case("bucketed", options)
    total, receivers = main.total_bytes, main.receivers
    limit_gbps = yardsticks.copy_bandwidth / (1 + receivers) / 1e9
    engine_copy_limit_gbps = yardsticks.engine_copy_bandwidth / (1 + receivers) / 1e9
    raw_gbps = total / yardsticks.raw_gloo_seconds / 1e9
    bucketed = results["bucketed"].gbps_p50
    rows = [{
        "backend": result.backend, "gbps_p50": round(result.gbps_p50, 4), "gbps_p90": round(result.gbps_p90, 4),
        "ratio_bucketed": round(result.gbps_p50 / bucketed, 4), "ratio_limit": round(result.gbps_p50 / limit_gbps, 4),
        "ratio_engine_copy_limit": round(result.gbps_p50 / engine_copy_limit_gbps, 4),
        "peak_extra_rss_mb": round(result.peak_extra_rss_mb, 1),
    } for result in results.values()]
    wall = time.perf_counter() - wall_started
    scenario = {
        "backends": list(backends), "model_bytes": total, "model_mb": round(total / MiB, 3), "mix": options.mix,
        "tensors": len(main.layout), "receivers": receivers, "bucket_mb": options.bucket_mb, "repeat": options.repeat,
        "cores": _cores(), "copiers": yardsticks.copiers,
        "copy_bandwidth_gbps": round(yardsticks.copy_bandwidth / 1e9, 3),
        "engine_copy_bandwidth_gbps": round(yardsticks.engine_copy_bandwidth / 1e9, 3),
        "bucketed_over_raw_gloo": round(bucketed / raw_gbps, 4), "wall_seconds": round(wall, 1),
        "seconds": {result.backend: [round(s, 4) for s in result.seconds] for result in results.values()},
    }

    print(f"model {total / MiB:g} MiB ({options.mix}, {len(main.layout)} tensors), {receivers} receivers, "
          f"buckets {options.bucket_mb} MiB, {options.repeat} updates after a warm-up; GB/s per receiver")
    print(f"limit {limit_gbps:.2f} GB/s = BW(k={yardsticks.copiers}) {yardsticks.copy_bandwidth / 1e9:.2f} GB/s "
          f"/ (1+R); raw gloo broadcast {raw_gbps:.2f} GB/s; bucketed = {bucketed / raw_gbps:.2f} x raw "
          f"({'meets' if bucketed >= 0.8 * raw_gbps else 'BELOW'} the 0.8 x raw bar)")
    print(f"(the engines copy large tensors with {STREAM_COPY} in 256 KiB pieces: BW(k) that way "
          f"{yardsticks.engine_copy_bandwidth / 1e9:.2f} GB/s, a limit of {engine_copy_limit_gbps:.2f} GB/s per "
          "receiver; JSON: ratio_engine_copy_limit)")
    print(f"{'backend':<10} {'p50':>7} {'p90':>7} {'x bucketed':>11} {'x limit':>8} {'peak extra RSS MiB':>19}")
    for row in rows:
        print(f"{row['backend']:<10} {row['gbps_p50']:>7.2f} {row['gbps_p90']:>7.2f} {row['ratio_bucketed']:>11.2f} "
              f"{row['ratio_limit']:>8.2f} {row['peak_extra_rss_mb']:>19.1f}")
    if ray_e2e is not None:
        stages = " + ".join(f"{step} {ms:.1f}" for step, ms in ray_e2e.to_json()["stages_ms_p50"].items())
        print(f"ray end-to-end ({ray_e2e.backend}): {ray_e2e.model_bytes / MiB:g} MiB update "
              f"{ray_e2e.update_p50 * 1e3:.2f} ms p50 = {ray_e2e.ratio:.2f} x a no-op call gathered from "
              f"{ray_e2e.workers} workers ({ray_e2e.noop_p50 * 1e3:.2f} ms p50); {stages} ms "
              f"({'meets' if ray_e2e.meets else 'MISSES'} the <= {E2E_TARGET:g} x bar)")
    else:
        print(f"ray end-to-end: {'FAILED' if ray_failed else 'skipped'} ({ray_skipped})")
    print(f"wall time {wall:.0f} s")
    if options.json_path:
        with open(options.json_path, "w") as handle:
            json.dump({"scenario": scenario, "limit_gbps": round(limit_gbps, 4),
                       "engine_copy_limit_gbps": round(engine_copy_limit_gbps, 4), "raw_gloo_gbps": round(raw_gbps, 4),
                       "results": rows,
                       "ray_end_to_end": ray_e2e.to_json() if ray_e2e is not None else {"skipped": ray_skipped}},
                      handle, indent=2)
    if options.trace_path:
        with open(options.trace_path, "w") as handle:
            json.dump(_chrome_trace(trace), handle)
    if options.plot_path:
        _plot(options.plot_path, sweep, options, total_bytes=_sweep_bytes(options))
    return 1 if ray_failed else 0


def _sweep_bytes(options: BenchOptions) -> int:
    # The sweep re-spawns every case at every point: a smaller model keeps it to a few minutes on two cores.
    return min(model_bytes(options), 256 * MiB)


def _sweep_cases(options: BenchOptions, backends: tuple[str, ...]) -> list[tuple[str, _Case]]:
    """Bucket sizes B/4, B, 2B at R = --receivers, and R = 1..3 at B: every backend and both baselines, 2 updates."""
    total = _sweep_bytes(options)
    cases: list[tuple[str, _Case]] = []
    for name in [*backends, *BASELINES]:
        for bucket_mb in sorted({max(1, options.bucket_mb // 4), options.bucket_mb, 2 * options.bucket_mb}):
            cases.append(("bucket", _case(name, options, bucket_mb=bucket_mb, total_bytes=total, repeat=2)))
        for receivers in (1, 2, 3):
            cases.append(("receivers", _case(name, options, receivers=receivers, total_bytes=total, repeat=2)))
    return cases


def _plot(path: str, sweep: list[tuple[str, str, float, float]], options: BenchOptions, *, total_bytes: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, (by_bucket, by_receivers) = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, axes, label in (("bucket", by_bucket, "bucket size (MiB)"), ("receivers", by_receivers, "receivers R")):
        for name in dict.fromkeys(backend for kind, backend, _, _ in sweep if kind == axis):
            points = sorted((x, y) for kind, backend, x, y in sweep if kind == axis and backend == name)
            axes.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name,
                      linestyle="--" if name in BASELINES else "-")
        axes.set_xlabel(label)
        axes.set_ylabel("GB/s per receiver (p50)")
        axes.grid(True, alpha=0.3)
    by_bucket.set_xscale("log", base=2)
    by_bucket.set_title(f"R = {options.receivers}")
    by_receivers.set_title(f"bucket {options.bucket_mb} MiB")
    by_receivers.set_xticks([1, 2, 3])
    by_receivers.legend(fontsize="small")
    figure.suptitle(f"weightsync bench: {total_bytes / MiB:g} MiB model ({options.mix}), 2 updates per point")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)



