"""``weightsync bench``: every backend side by side with two gloo baselines and this host's copy-bandwidth limit.

``driver`` spawns the processes, times updates and writes the table, JSON, trace and plot; ``worker`` is what runs
in each spawned process.
"""

from weightsync.cli.bench.driver import BenchOptions, BenchResult, model_layout, run_bench

__all__ = ["BenchOptions", "BenchResult", "model_layout", "run_bench"]
