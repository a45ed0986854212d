"""``weightsync bench``: every backend side by side with two gloo baselines and this host's copy-bandwidth limit.

``driver`` runs the whole command; ``scenario`` says what is measured (options, model layout, cases), ``measure``
spawns one case's processes and times them, ``worker`` is what runs in each spawned process, ``ray_e2e`` the Ray
end-to-end figure, ``sweep`` the ``--plot`` sweep, and ``report`` the table, JSON and trace.
"""

from weightsync.cli.bench.driver import run_bench
from weightsync.cli.bench.measure import BenchResult
from weightsync.cli.bench.scenario import BenchOptions, model_layout

__all__ = ["BenchOptions", "BenchResult", "model_layout", "run_bench"]
