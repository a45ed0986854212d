"""An idle nixl engine must not burn a core: nixl's own progress thread spins with a zero delay, ours sleeps.

Measured from outside: the CPU time the kernel charges a child process (``/proc/<pid>/stat``) while the engine's
ring sits idle in it. The negative control runs the same checker on a bare agent with nixl's default configuration.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("nixl")

IDLE_SECONDS = 2.0
CHILD = r"""
import os, sys, time
if sys.argv[1] == "ours":
    from weightsync.nixl.engine import ACTIVE_WINDOW, NixlRing
    ring = NixlRing(slots=2, slot_bytes=1 << 20, device="cpu", agent_name="idle-ours")
    time.sleep(ACTIVE_WINDOW + 0.5)  # past the window after construction, when the thread polls fast
else:
    import nixl._api as api
    agent = api.nixl_agent("idle-default", api.nixl_agent_config(backends=["UCX"]))
    time.sleep(0.5)
print("ready", flush=True)
time.sleep(60)
os._exit(0)  # nixl 1.5.1 can crash in interpreter teardown; nothing to flush here
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def idle_core_share(kind: str) -> float:
    """Share of one core the child uses while its agent sits idle for ``IDLE_SECONDS``."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
    try:
        assert child.stdout is not None
        for line in child.stdout:  # nixl logs to stdout too
            if line.strip() == "ready":
                break
        else:
            raise AssertionError(f"the child exited before its agent was up (code {child.wait(10)})")
        before, started = _cpu_seconds(child.pid), time.monotonic()
        time.sleep(IDLE_SECONDS)
        return (_cpu_seconds(child.pid) - before) / (time.monotonic() - started)
    finally:
        child.kill()
        child.wait(10)


def check_idle(share: float) -> None:
    if share > 0.1:
        raise AssertionError(f"an idle nixl agent used {share:.0%} of a core")


def test_idle_engine_does_not_spin() -> None:
    check_idle(idle_core_share("ours"))


def test_idle_check_fails_nixls_default_progress_thread() -> None:
    share = idle_core_share("default")
    with pytest.raises(AssertionError, match="of a core"):
        check_idle(share)
