"""The driver of ``weightsync bench``: every measured case spawns 1 sender + R receivers and times whole updates.

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

With ``--hosts H`` the same cases run across an emulated testbed of H hosts (see ``hosts``): the sender on host 0,
R receivers on each other host, every link shaped to ``--link-gbps``; each case's link counters are read around every
timed update, and backends that cannot cross hosts are skipped.

With ``--staged`` (see ``serving``) every receiver of every entry serves while it is not paused, and every entry
B gets a twin ``B+staged``: the update is staged on each host's first receiver while all serve, then every receiver
swaps (the bench swaps them once every host has staged, where the manager swaps each replica as soon as its own
hosts have). A staged entry's time runs from the start of the stage to the last resume.

With ``--parts tp2|layers2`` every entry B gets a twin ``B+tp2`` (``B+layers2``): the same receivers in replicas of
two workers, each holding its part (``scenario.bench_part``) and only that (shards of its boxes), each reading,
copying and hashing only its part of every update. The report compares each twin with B: the update's time, and the
receivers' busy seconds (their transfer reports' ``unpack`` phase). With ``--hosts`` and an even number of
receiving hosts a replica's two workers sit on two hosts (``Case.replicas``), and only ``auto`` gets the twin: its
two-level layout gives each group of hosts that hold the same a stream of its own
(``weightsync.core.transports.chain.groups``), so each host takes in only its half (with ``tp2`` of every split tensor
its rank's span: ``weightsync.core.wire.carriers``).

With ``--sharded`` (``--actor-ranks M``, shm or auto) the M actor ranks hold the model under FSDP2 over gloo (see
``sharded``), and every backend B is measured as two entries, side by side: ``B+sharded`` (every rank sends its
shards at once) and ``B+gathered`` (every rank all-gathers each parameter, rank 0 sends: today's path). The report
gives gathered / sharded (update time, p50) and each actor rank's bytes sent; every receiver's model is compared with
the version sent after the timed updates. With ``--hosts`` (auto only) the ranks sit on host 0, one per rail as
``--actor-ranks`` places them, and the baseline is ``B`` itself: the same ranks holding the whole model, which auto
stripes over the rails. The report gives sharded / striped (update time, p50) and each rank's rail egress / S.
(``B+gathered`` is not measured across hosts: it sends from rank 0's rail alone, slower by design, not the bar.)

Also measured, unless ``--no-ray`` or ``--hosts`` (see ``ray_e2e``): ``CheckpointEngineManager.update_weights`` of a 1 MiB model
through the Ray adapter, pause → resume included, against one no-op call gathered from every worker (target: at
most 5 ×). The JSON's ``ray_end_to_end`` holds those figures, or ``{"skipped": reason}``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from weightsync.api.config import MiB
from weightsync.api.registry import available_backends, load_engine_class
from weightsync.cli.bench.measure import (COPY_TRIES, RAW_TRIES, BenchResult, LocalPlacement, Placement,
                                         PlacementUnavailable, Yardsticks, measure_case)
from weightsync.cli.bench.ray_e2e import measure_ray_end_to_end, ray_unavailable
from weightsync.cli.bench.report import RayOutcome, Summary, chrome_trace, print_report, write_json
from weightsync.cli.bench.rl import RLVersions, make_versions
from weightsync.cli.bench.scenario import (BASELINES, DELTA, GATHERED, SHARDED, STAGED, BenchOptions, Case, make_case,
                                          model_bytes, model_layout)
from weightsync.cli.bench.sweep import measure_sweep, plot, sweep_bytes, sweep_cases, sweep_steps
from weightsync.cli.progress import Progress
from weightsync.core.control.auto import AUTO

__all__ = ["BenchOptions", "BenchResult", "model_layout", "run_bench"]

RAY_WARMUP = 3
RAY_REPEAT = 20
RAY_ACTOR_RANKS = 2


def run_bench(options: BenchOptions) -> int:
    wall_started = time.perf_counter()
    backends = options.backends or (*available_backends(), AUTO)
    if not _backends_usable(backends):
        return 2
    skipped: tuple[str, ...] = ()
    if options.hosts:
        from weightsync.cli.bench.hosts import cross_host_split  # (see _placement)

        backends, skipped = cross_host_split(backends)
        for name in skipped:
            print(f"weightsync bench --hosts: skipping {name}: it cannot cross hosts", file=sys.stderr)
    ray_skipped, ray_backend = _ray_plan(options, backends)
    plotting = None
    if options.plot_path:
        try:
            import matplotlib  # noqa: F401  (checked first: a missing extra should not cost a whole run)
        except ImportError:
            print("weightsync bench --plot needs matplotlib: pip install matplotlib "
                  "(or pip install 'weightsync-cli[plot]')", file=sys.stderr)
            return 2
        plotting = sweep_cases(options, backends)
    names = [name for backend in backends
             for name in ((backend, backend + DELTA) if options.delta and _supports_delta(backend) else (backend,))]
    if options.parts:  # each entry of replicas of two workers that hold parts right after its whole-model twin
        # (across hosts auto's only: its two-level layout delivers by part; a named backend's rank-order chain is
        # host-oblivious, and a replica's workers on two hosts would take the model into each host twice)
        names = [entry for name in names for entry in (
            (name, _with_parts(name, options.parts)) if not options.hosts or name.startswith(AUTO) else (name,))]
    if options.staged:  # each staged entry right after its unstaged twin
        names = [entry for name in names for entry in (name, name + STAGED)]
    if options.sharded:  # an FSDP2 actor_wg: each rank sends its shards, against the same ranks gathering first
        # (across hosts against the whole model striped over the same ranks: the send a sharded one should match)
        names = [entry for name in names
                 for entry in ((name, name + SHARDED) if options.hosts else (name + SHARDED, name + GATHERED))]
    names += BASELINES
    versions = _version_count(options)
    progress = Progress(_steps(options, names, ray=ray_skipped is None, plotting=plotting) + versions, clock=True)
    yardsticks = Yardsticks()
    trace: list[dict[str, Any]] = []
    rl: RLVersions | None = None
    try:
        if versions:
            rl = make_versions(model_bytes(options), versions, lr=options.lr, step=progress.step)
        with _placement(options) as where:
            results = _measure_cases(options, names, progress, where, yardsticks, trace, rl)
    except PlacementUnavailable as error:
        progress.finish()
        print(f"weightsync bench --hosts: {error}", file=sys.stderr)
        return 2
    finally:
        if rl is not None:
            rl.remove()
    ray = RayOutcome(None, ray_skipped) if ray_skipped is not None else _measure_ray(options, ray_backend, progress)
    sweep = measure_sweep(plotting, progress) if plotting is not None else []
    progress.finish()

    summary = Summary(options=options, backends=backends, main=make_case("bucketed", options, rl=rl), results=results,
                      yardsticks=yardsticks, wall_seconds=time.perf_counter() - wall_started, skipped=skipped,
                      changed_fraction=rl.changed_fraction(range(1, 1 + options.repeat)) if rl else None)
    print_report(summary, ray)
    if options.json_path:
        write_json(options.json_path, summary, ray)
    if options.trace_path:
        with open(options.trace_path, "w") as handle:
            json.dump(chrome_trace(trace), handle)
    if options.plot_path:
        plot(options.plot_path, sweep, options, total_bytes=sweep_bytes(options))
    return 1 if ray.failed else 0


def _placement(options: BenchOptions) -> contextlib.AbstractContextManager[Placement]:
    """This machine, or (``--hosts``) a testbed built for the block (``hosts``), imported only then: the testbed is
    an extra of the CLI (``weightsync-cli[testbed]``), which ``main`` checks for before any work."""
    if not options.hosts:
        return contextlib.nullcontext(LocalPlacement())
    from weightsync.cli.bench.hosts import placement

    return placement(options)


def _with_parts(name: str, parts: str) -> str:
    """The entry ``name`` with its receivers holding ``parts``: ``B+delta`` → ``B+tp2+delta``."""
    backend = name.removesuffix(DELTA)
    return f"{backend}+{parts}{name[len(backend):]}"


def _supports_delta(backend: str) -> bool:
    """Whether ``backend`` takes ``delta=True`` (auto picks among bucket backends, which all do); one that does not is
    said so and measured full only."""
    if backend == AUTO or load_engine_class(backend).supports_delta:
        return True
    print(f"weightsync bench --delta: {backend} sends full updates only: no {backend}{DELTA} entry", file=sys.stderr)
    return False


def _version_count(options: BenchOptions) -> int:
    """With ``--mix rl``: the versions the run sends (a warm-up, the timed updates, the traced one), else 0."""
    return 1 + options.repeat + (1 if options.trace_path else 0) if options.mix == "rl" else 0


def _measure_cases(options: BenchOptions, names: list[str], progress: Progress, where: Placement,
                   yardsticks: Yardsticks, trace: list[dict[str, Any]], rl: RLVersions | None
                   ) -> dict[str, BenchResult]:
    results: dict[str, BenchResult] = {}
    traced = next((name for name in names if name.endswith(DELTA)), names[0]) if options.delta else names[0]
    # (a staged entry is not traced: its stage and swap are two steps of their own)
    for name in names:
        results[name] = measure_case(make_case(name, options, rl=rl), progress,
                                     trace=trace if options.trace_path and name == traced else None,
                                     yardsticks=yardsticks if name == "bucketed" else None, placement=where)
    return results


def _backends_usable(backends: tuple[str, ...]) -> bool:
    """False (having said why) for a baseline's name; an unknown or uninstalled backend raises, naming what to
    install."""
    for backend in backends:
        if backend in BASELINES:
            print(f"weightsync bench: {backend!r} is a baseline and always runs; do not list it", file=sys.stderr)
            return False
        if backend != AUTO:
            load_engine_class(backend)
    return True


def _ray_plan(options: BenchOptions, backends: tuple[str, ...]) -> tuple[str | None, str]:
    """Why the Ray end-to-end figure is skipped (None: it runs), and the backend it runs with."""
    ray_skipped = "--hosts" if options.hosts else ray_unavailable() if options.ray else "--no-ray"
    ray_backend = options.ray_backend or ""
    if ray_skipped is None:
        if not ray_backend:
            ray_backend = "shm" if "shm" in available_backends() else backends[0]
        if ray_backend != AUTO:
            load_engine_class(ray_backend)
    return ray_skipped, ray_backend


def _steps(options: BenchOptions, names: list[str], *, ray: bool, plotting: list[tuple[str, Case]] | None) -> int:
    """The progress bar's length: every warm-up, timed update and yardstick try is a step."""
    steps = len(names) * (1 + options.repeat) + RAW_TRIES + COPY_TRIES + (1 if options.trace_path else 0)
    if ray:
        steps += RAY_WARMUP + RAY_REPEAT
    if plotting is not None:
        steps += sweep_steps(plotting)
    return steps


def _measure_ray(options: BenchOptions, backend: str, progress: Progress) -> RayOutcome:
    progress.step(f"ray e2e: starting Ray ({backend})", count=0)
    try:
        return RayOutcome(measure_ray_end_to_end(
            backend=backend, workers=RAY_ACTOR_RANKS, replicas=options.receivers, repeat=RAY_REPEAT,
            warmup=RAY_WARMUP, bucket_bytes=options.bucket_mb * MiB, step=progress.step,
        ))
    except Exception as exc:  # noqa: BLE001 - the table is measured already: report the failure, keep it
        return RayOutcome(None, f"failed: {type(exc).__name__}: {exc}", failed=True)
