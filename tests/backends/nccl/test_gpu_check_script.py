"""tools/gpu-check/gpu_check.py runs on CPU far enough to parse its arguments, import our packages and say clearly
that there is no CUDA device (exit code 4)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[3] / "tools" / "gpu-check" / "gpu_check.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_dry_run_parses_arguments_and_imports() -> None:
    done = _run("--dry-run", "--quick")
    assert done.returncode == 0, done.stderr
    assert "dry run: imports fine" in done.stdout and "64 MiB" in done.stdout


def test_bad_arguments_are_rejected() -> None:
    done = _run("--bucket-mib", "0")
    assert done.returncode == 2 and "must be positive" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_says_so_and_exits_4() -> None:
    done = _run("--quick")
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert "no CUDA device here" in done.stderr


@pytest.mark.device
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_passes_on_a_gpu() -> None:
    done = _run("--quick")
    assert done.returncode == 0, done.stdout + done.stderr
