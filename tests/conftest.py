"""Shared fixtures: one two-node Ray cluster for the whole session (started only if a test asks for it)."""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Ray workers and the harness's fork server (its workers fork from it) import tests.workloads by name.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))


# Ray keeps its state in a folder of this test run, not in the machine's default (/tmp/ray): a test cluster writes
# ``ray_current_cluster`` there (``ray.cluster_utils.Cluster`` does, and removes it only on a clean shutdown), and a
# bare ``ray.init()`` anywhere else on the machine would then try to join this run's cluster. Every Ray process the
# tests start inherits it.
# Made once per test run: this module is imported again as ``tests.conftest`` by tests that name its fixtures'
# types, and a process the tests start inherits the folder (only the process that made it removes it).
_MADE_HERE = "WEIGHTSYNC_TESTS_RAY_TMPDIR" not in os.environ
if _MADE_HERE:
    os.environ["WEIGHTSYNC_TESTS_RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ws-ray-")
RAY_TMPDIR = os.environ["WEIGHTSYNC_TESTS_RAY_TMPDIR"]
os.environ["RAY_TMPDIR"] = RAY_TMPDIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _MADE_HERE:
        shutil.rmtree(RAY_TMPDIR, ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the emulated accelerator once, before any worker process needs it (nothing is registered here)."""
    try:
        from weightsync.emuaccel import build
    except ImportError:  # an environment without it (the verl env has it too; a bare one may not)
        return
    build()


@dataclass(frozen=True)
class RayNodes:
    head: str
    other: str


@pytest.fixture(scope="session")
def ray_nodes() -> Iterator[RayNodes]:
    """A Ray cluster of two raylets on this machine; tests pin actors to ``head`` unless they test crossing."""
    import ray
    from ray.cluster_utils import Cluster

    cluster: Any = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=4)
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()
    head = ray.get_runtime_context().get_node_id()
    others = [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["NodeID"] != head]
    try:
        yield RayNodes(head=head, other=others[0])
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def hide_backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``hide_backend("nixl")``: make this process's registry behave as if that backend's package were absent."""
    from weightsync.api import registry

    def hide(name: str) -> None:
        registry.installed_backends()  # scan the entry points first, then drop the one to hide
        monkeypatch.setattr(registry, "_specs", {k: v for k, v in registry._specs.items() if k != name})

    return hide
