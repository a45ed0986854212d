"""The tests' Ray clusters leave the machine's Ray state alone: the address file a test cluster writes (which a bare
``ray.init()`` elsewhere on the machine would join) lies in this run's folder (``tests.conftest.RAY_TMPDIR``)."""

from __future__ import annotations

import os
import subprocess
import sys

import ray

from tests.conftest import RAY_TMPDIR, RayNodes

READ_ADDRESS = "from ray._private.utils import read_ray_address; print(read_ray_address() or '')"


def recorded_address(env: dict[str, str]) -> str:
    """The cluster a bare ``ray.init()`` in a process with ``env`` would join, read by Ray itself there."""
    done = subprocess.run([sys.executable, "-c", READ_ADDRESS], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout.strip()


def test_the_test_cluster_is_recorded_in_this_runs_folder_not_the_machines(ray_nodes: RayNodes) -> None:
    address = ray.get_runtime_context().gcs_address
    machine = {name: value for name, value in os.environ.items()
               if name not in ("RAY_TMPDIR", "TMPDIR", "RAY_ADDRESS")}
    assert recorded_address(machine) != address
    # The checker sees the address where it is (this run's processes), so it would see it in the machine's folder.
    assert recorded_address({**machine, "RAY_TMPDIR": RAY_TMPDIR}) == address
