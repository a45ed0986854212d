"""kimi in processes whose default gloo group already exists (every verl worker has one): prepare, topology and
the ParameterServer's group setup run for real (its collectives on kimi's private groups), and the caller's default
group is checked afterwards by using it — with controls showing that check fails when the group is destroyed or
taken over, as checkpoint-engine's stock path would do."""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import queue
import socket
from typing import Any

import pytest

from tests.backends.kimi.default_group import run_worker
from weightsync.api.errors import BackendUnavailableError
from weightsync.core.backend import c10d
from weightsync.kimi.library import CheckpointEngineLibrary

SIZE = 3
TIMEOUT = datetime.timedelta(seconds=30)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run(mode: str) -> list[dict[str, Any]]:
    """``SIZE`` spawned processes (clean interpreters, as real workers are) in ``mode``; their reports by index."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [context.Process(target=run_worker, args=(index, SIZE, port, mode, results)) for index in range(SIZE)]
    for worker in workers:
        worker.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        for _ in range(SIZE):
            index, report = results.get(timeout=120)
            reports[index] = report
    except queue.Empty:
        pytest.fail(f"workers did not report in time: {sorted(reports)} of {SIZE} did ({reports})")
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
    errors = {index: report["error"] for index, report in reports.items() if "error" in report}
    assert not errors, "\n".join(f"process {index}:\n{error}" for index, error in errors.items())
    return [reports[index] for index in range(SIZE)]


def test_kimi_sets_up_beside_the_default_group_and_leaves_it_intact() -> None:
    reports = _run("kimi")
    for index, report in enumerate(reports):
        assert report["before"] == [] and report["after"] == [], (index, report)
        assert report["environment"] == (str(index), str(SIZE)), "the caller's RANK/WORLD_SIZE were changed"
        assert report["restored"], "checkpoint-engine's own Distributed implementation was not put back"
        assert len(report["epochs"]) == 2
        for epoch in report["epochs"]:
            assert epoch["during"] == [], epoch  # the default group works while the PS's group exists
            assert epoch["installed"] == "PrivateGroupsDistributed"
            assert epoch["ps_rank"] == (2 if index == 0 else 2 - index)
            # the PS world's own collectives: ordered by PS rank, not by the caller's rank
            assert [host for host, _, _ in epoch["gathered"]] == ["ps-0", "ps-1", "ps-2"]
            assert epoch["gathered"][1][2] == [{"name": "w1", "dtype": "torch.bfloat16", "shape": (1, 3),
                                                "aligned_size": 64}]
            assert epoch["dtype"] == "torch.bfloat16"  # validated back into a torch dtype, not left a string
            assert epoch["sum"] == [6, 21]
            assert epoch["subgroup"] == (None if epoch["ps_rank"] == 0 else 102)  # broadcast from PS rank 2


@pytest.mark.parametrize("mode", ["destroy", "replace"])
def test_the_check_fails_when_the_default_group_is_destroyed_or_taken_over(mode: str) -> None:
    reports = _run(mode)
    for index, report in enumerate(reports):
        assert report["before"] == [], report
        assert report["after"], f"process {index}: the check missed a {mode}d default group"
    if mode == "destroy":
        assert all(report["after"] == ["there is no default group any more"] for report in reports)
    else:
        # checkpoint-engine's stock TorchBackend cannot share the process: it initialises the default group...
        assert all("twice" in report["refused"] for report in reports), reports
        # ...and where that group was given up for it, the caller's ranks come back in the PS's order.
        assert all("torch.distributed.group.WORLD is another group" in report["after"] for report in reports)
        assert any("all_gather of the caller's ranks gave [2, 1, 0]" in problem for problem in reports[0]["after"])


# -- the private groups' refusals, in this process (a one-rank world over a HashStore) -----------------------------


class _Server:
    """Stands in for a ParameterServer's ``init_process_group``: checkpoint-engine's own entry point, as the PS
    calls it."""

    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend

    def init_process_group(self, *, timeout: datetime.timedelta) -> None:
        ce_dist = importlib.import_module("checkpoint_engine.distributed")
        ce_dist.init_process_group(0, 1, c10d.HashStore(), backend=self.backend, timeout=timeout)


def _stock() -> Any:
    return importlib.import_module("checkpoint_engine.distributed.base")._BACKEND_INSTANCE


def test_one_kimi_engine_per_process_and_checkpoint_engine_gets_its_backend_back() -> None:
    stock, first, second = _stock(), CheckpointEngineLibrary(), CheckpointEngineLibrary()
    first.join_group(_Server(), timeout=TIMEOUT)  # type: ignore[arg-type]
    try:
        assert _stock() is first.groups and first.all_reduce_sum([3, 4], ps_rank=0) == [3, 4]
        with pytest.raises(BackendUnavailableError, match="one kimi engine per process"):
            second.join_group(_Server(), timeout=TIMEOUT)  # type: ignore[arg-type]
        assert _stock() is first.groups  # the refused one changed nothing
        ce_dist = importlib.import_module("checkpoint_engine.distributed")
        with pytest.raises(TypeError, match="never pickle"):
            ce_dist.all_gather_object([None], {"a": 1})
    finally:
        first.destroy_process_group()
    assert _stock() is stock and first.groups is None


@pytest.mark.parametrize("backend", ["hccl", "fail"])
def test_a_failed_join_puts_checkpoint_engines_backend_back(backend: str) -> None:
    stock, library = _stock(), CheckpointEngineLibrary()

    class Failing(_Server):
        def init_process_group(self, *, timeout: datetime.timedelta) -> None:
            raise RuntimeError("the PS's rank 0 never came")

    server = _Server(backend) if backend == "hccl" else Failing()
    with pytest.raises(BackendUnavailableError if backend == "hccl" else RuntimeError,
                       match="nccl and gloo only" if backend == "hccl" else "never came"):
        library.join_group(server, timeout=TIMEOUT)  # type: ignore[arg-type]
    assert _stock() is stock and library.groups is None
