"""Processes inside hosts: how a Popen of ``nsenter`` stands for the program it runs, and how teardown reaps it."""

from __future__ import annotations

import os
import signal
import subprocess

from weightsync.testbed.cleanup import CleanupReport

__all__ = ["HostProcess", "reap"]

REAP_TIMEOUT_S = 15.0


class HostProcess(subprocess.Popen[bytes]):
    """A process in a host, as returned by :meth:`Testbed.popen`: a Popen of the ``nsenter`` that entered the host.

    ``nsenter`` forks to enter the host's PID namespace and waits for the program, exiting as it does (with its
    exit code, or killed by its signal), so ``wait()``/``returncode``/pipes behave as for the program itself;
    ``pid`` is nsenter's. ``send_signal``/``terminate`` signal the program (nsenter would not pass a signal on);
    ``kill`` kills nsenter and the program together (their process group).
    """

    host: int

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is not None:
            return
        target = None if sig == signal.SIGKILL else _first_child(self.pid)
        try:
            if target is not None:
                os.kill(target, sig)
            else:
                os.killpg(self.pid, sig)  # the session nsenter leads: nsenter and the program (and its group)
        except ProcessLookupError:
            pass


def _first_child(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            pids = children.read().split()
    except OSError:
        return None
    return int(pids[0]) if pids else None


def reap(process: subprocess.Popen[bytes], report: CleanupReport) -> None:
    try:
        process.wait(timeout=REAP_TIMEOUT_S)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=REAP_TIMEOUT_S)
    except (ProcessLookupError, subprocess.TimeoutExpired) as error:
        report.errors.append(f"process {process.pid} outlived its host: {error!r}")
