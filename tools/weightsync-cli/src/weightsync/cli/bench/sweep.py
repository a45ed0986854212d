"""``weightsync bench --plot``: bucket size and R swept around the chosen point, GB/s per backend plotted."""

from __future__ import annotations

from weightsync.api.config import MiB
from weightsync.cli.bench.measure import measure_case
from weightsync.cli.bench.scenario import BASELINES, BenchOptions, Case, make_case, model_bytes
from weightsync.cli.progress import Progress

__all__ = ["SweepPoint", "measure_sweep", "plot", "sweep_bytes", "sweep_cases", "sweep_steps"]

SweepPoint = tuple[str, str, float, float]
"""(axis, backend, x, GB/s p50)"""


def sweep_bytes(options: BenchOptions) -> int:
    # The sweep re-spawns every case at every point: a smaller model keeps it to a few minutes on two cores.
    return min(model_bytes(options), 256 * MiB)


def sweep_cases(options: BenchOptions, backends: tuple[str, ...]) -> list[tuple[str, Case]]:
    """Bucket sizes B/4, B, 2B at R = --receivers, and R = 1..3 at B: every backend and both baselines, 2 updates."""
    total = sweep_bytes(options)
    cases: list[tuple[str, Case]] = []
    for name in [*backends, *BASELINES]:
        for bucket_mb in sorted({max(1, options.bucket_mb // 4), options.bucket_mb, 2 * options.bucket_mb}):
            cases.append(("bucket", make_case(name, options, bucket_mb=bucket_mb, total_bytes=total, repeat=2)))
        for receivers in (1, 2, 3):
            cases.append(("receivers", make_case(name, options, receivers=receivers, total_bytes=total, repeat=2)))
    return cases


def _point(case: Case) -> tuple[str, int, int]:
    # The point (B, R) sits on both axes: it is measured once.
    return case.name, case.bucket_bytes, case.receivers


def sweep_steps(cases: list[tuple[str, Case]]) -> int:
    """Progress steps the sweep takes: a warm-up and the timed updates of each point measured."""
    return sum(1 + case.repeat for case in {_point(case): case for _, case in cases}.values())


def measure_sweep(cases: list[tuple[str, Case]], progress: Progress) -> list[SweepPoint]:
    measured: dict[tuple[str, int, int], float] = {}
    sweep: list[SweepPoint] = []
    for axis, case in cases:
        if _point(case) not in measured:
            measured[_point(case)] = measure_case(case, progress).gbps_p50
        sweep.append((axis, case.name, case.bucket_bytes / MiB if axis == "bucket" else case.receivers,
                      measured[_point(case)]))
    return sweep


def plot(path: str, sweep: list[SweepPoint], options: BenchOptions, *, total_bytes: int) -> None:
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
