"""Docker's default ``/dev/shm`` (a 64 MiB tmpfs): a named error before any byte moves, every process alive, and
``auto`` finding a layout that fits.

The driver (``small_shm_driver``) and ``weightsync doctor`` run in a private mount namespace (``unshare -m``) with a
64 MiB tmpfs mounted on its ``/dev/shm``: every process started in it (Ray, the workers) sees that ``/dev/shm`` and
the machine's own is never touched; the mount goes with the namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare(1) for a private mount namespace")

_SCRIPT = """
set -e
mount -t tmpfs -o size=64m wst-small-shm /dev/shm
"$0" -m weightsync.cli doctor
"$0" -m tests.reliability.small_shm_driver
"""


@pytest.fixture(scope="module")
def inside() -> tuple[str, dict[str, object]]:
    """What ``weightsync doctor`` printed inside the namespace, and the driver's result."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    done = subprocess.run(["unshare", "-m", "sh", "-c", _SCRIPT, sys.executable], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert "Task exception was never retrieved" not in done.stdout + done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return done.stdout, json.loads(line.removeprefix("RESULT "))


def test_doctor_says_shm_does_not_fit(inside: tuple[str, dict[str, object]]) -> None:
    doctor, _ = inside
    (line,) = [line for line in doctor.splitlines() if line.startswith("shared memory: ")]
    assert "/dev/shm: 64.0 MiB" in line and "shm's ring needs 256 MiB (does NOT fit)" in line, line
    assert "--shm-size" in line, line
    assert "auto picks tcp (flat chain: /dev/shm too small) when every worker shares the sender's host" in doctor


def test_an_shm_ring_that_does_not_fit_is_a_named_error_and_every_process_lives(
        inside: tuple[str, dict[str, object]]) -> None:
    _, result = inside
    shm = result["shm"]
    assert isinstance(shm, dict)
    assert shm["error"] == "SharedMemoryFullError" and shm["path"] == "/dev/shm", shm
    assert shm["message"].startswith("/dev/shm has 64.0 MiB free of 64.0 MiB, too little for the shm backend's ring "
                                     "(4 slots of 64.0 MiB)") and "--shm-size" in shm["message"], shm["message"]
    assert shm["seconds"] < 5, shm  # within 5 s of the call
    assert shm["alive"] and shm["shm_after"] == [], shm  # the ring's first segment, which fitted, is gone too
    assert [state for state, _ in shm["states"]] == ["untouched"] * 2, shm
    assert shm["hooks"] == [[], []], shm  # never paused: setup failed before any replica was


def test_auto_picks_a_flat_chain_that_fits_and_says_why(inside: tuple[str, dict[str, object]]) -> None:
    _, result = inside
    auto = result["auto"]
    assert isinstance(auto, dict)
    assert auto["ok"] and auto["backend"] == "tcp", auto
    assert "but /dev/shm on " in auto["chosen"] and "has 64.0 MiB free and shm's ring needs 256.0 MiB, so a flat " \
        "chain" in auto["chosen"], auto["chosen"]
    assert auto["digests"] == [result["v1"]] * 2 and auto["alive"] and auto["shm_after"] == [], auto


def test_a_staged_update_larger_than_shm_is_refused_naming_it(inside: tuple[str, dict[str, object]]) -> None:
    _, result = inside
    staged = result["staged"]
    assert isinstance(staged, dict)
    assert staged["error"] == "SharedMemoryFullError" and "too little for this host's staging area" in \
        staged["message"] and "SyncConfig(staged=False)" in staged["message"], staged
    assert staged["alive"] and staged["shm_after"] == [], staged  # the area that did not fit is given back
    assert staged["digests"] == [result["v1"]] * 2, staged  # still serving version 1
    assert result["shm_end"] == []
