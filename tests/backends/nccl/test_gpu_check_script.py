"""tools/gpu-check/gpu_check.py: its arguments and imports, and a ``--quick`` run on the emulated accelerator (what it
runs on a GPU machine, less what needs CUDA and less the conformance lines the suite runs itself), with its time
bound checked by a check that never returns."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "tools" / "gpu-check" / "gpu_check.py"
SUMMARY = re.compile(r"gpu-check: device=(\w+) ok=(\d+) failed=(\d+)(?: \(.*?\))? skipped=(\d+)(?: \(.*\))? in \d+ s")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def _summary(done: subprocess.CompletedProcess[str]) -> re.Match[str]:
    """The one-line summary, which must be the last line printed."""
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    match = SUMMARY.fullmatch(last)
    assert match is not None, (done.stdout, done.stderr)
    return match


def test_dry_run_parses_arguments_and_imports() -> None:
    done = _run("--dry-run", "--quick")
    assert done.returncode == 0, done.stderr
    assert "dry run: imports fine" in done.stdout and "64 MiB" in done.stdout


def test_bad_arguments_are_rejected() -> None:
    done = _run("--bucket-mib", "0")
    assert done.returncode == 2 and "must be positive" in done.stderr
    done = _run("--device", "tpu")
    assert done.returncode == 2 and "invalid choice" in done.stderr
    done = _run("--device", "emu", "--only", "buckets,no-such-check")
    assert done.returncode == 2 and "unknown check names in --only: no-such-check" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what --device auto picks without CUDA")
def test_without_cuda_auto_runs_on_the_emulated_device() -> None:
    done = _run("--quick", "--only", "buckets,ipc")
    assert done.returncode == 0, (done.stdout, done.stderr)
    summary = _summary(done)
    assert summary.group(1) == "emu" and summary.group(2, 3, 4) == ("1", "0", "1")
    assert "(ipc: needs CUDA)" in summary.group(0)


def test_a_check_past_its_budget_fails_and_the_rest_still_run() -> None:
    # "hang" never returns: it is killed at its budget, and a fresh child runs the check after it.
    done = _run("--device", "emu", "--quick", "--only", "hang,buckets", "--check-budget", "3")
    assert done.returncode == 1, (done.stdout, done.stderr)
    summary = _summary(done)
    assert summary.group(2, 3) == ("1", "1") and "failed=1 (hang)" in summary.group(0)
    assert "did not finish within its budget of 3 s (killed)" in done.stdout


QUICK_ON_EMU = ("buckets", "copy", "legs", "bounce", "overlap", "ipc", "shm/mixed", "accel-gloo/mixed",
                "nixl/cuda-ring/mixed", "mooncake/cuda-ring/mixed", "nccl/device")
"""What CI runs of a ``--quick`` run: every measuring check, and one conformance line of each kind the script builds
(a host ring, the accelerator collective engine; the device rings' and nccl's skip without CUDA). The other host
rings' lines (gloo, tcp, nixl, mooncake) are the same kit with the same placement, which the suite runs itself
(``tests/backends/<name>/test_<name>_conformance.py``, ``Test<Name>MixedDevices``): here they would cost CI a minute
to prove nothing more."""


@pytest.mark.slow
def test_quick_run_on_the_emulated_device_passes(tmp_path: pathlib.Path) -> None:
    report = tmp_path / "gpu-check.json"
    done = _run("--device", "emu", "--quick", "--only", ",".join(QUICK_ON_EMU), "--json", str(report), timeout=480)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    summary = _summary(done)
    assert summary.group(1) == "emu" and summary.group(3) == "0"
    results = {result["check"]: result for result in json.loads(report.read_text())["results"]}
    assert set(results) == set(QUICK_ON_EMU)
    for check in ("buckets", "copy", "legs", "bounce", "overlap", "shm/mixed", "accel-gloo/mixed"):
        assert results[check]["status"] == "ok", results[check]
    for check in ("ipc", "nixl/cuda-ring/mixed", "mooncake/cuda-ring/mixed", "nccl/device"):
        assert results[check]["status"] == "skipped" and results[check]["reason"] == "needs CUDA", results[check]
    assert results["shm/mixed"]["figures"]["tests"] >= 8
    bounce = results["bounce"]["figures"]
    assert bounce["d2h_gbps"] > 0 and bounce["h2d_gbps"] > 0 and bounce["d2h_ratio"] > 0


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_passes_on_a_gpu() -> None:
    done = _run("--quick", timeout=480)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _summary(done).group(1) == "cuda"
