"""The testbed's contact with the machine: the tools it runs, its names, its errors.

Every command runs with a timeout and is checked; every name the testbed creates starts with ``wst-`` and encodes
the process that owns it, so that :func:`~weightsync.testbed.cleanup` can tell the leftovers of a killed run from
a testbed that another live process is using (a shared CI machine may run several at once).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PREFIX",
    "RunName",
    "TestbedError",
    "TestbedUnavailable",
    "Tools",
    "command",
    "find_tools",
    "kill_pids",
    "list_netns",
    "netns_pids",
    "owner_alive",
    "process_start_ticks",
]

PREFIX = "wst-"

# wst-<owner pid>-<owner start time in clock ticks>-<random>; a pid alone could be reused by another process.
_RUN_RE = re.compile(r"^(wst-(\d+)-(\d+)-([0-9a-f]+))(?:-(h\d+|sw|probe))?$")


class TestbedError(RuntimeError):
    """Building, using or removing the testbed failed (a command failed or timed out, a host is gone)."""

    __test__ = False  # not a pytest test class, despite the name


class TestbedUnavailable(TestbedError):
    """This machine cannot host the testbed; ``reason`` says why in one line (not root, no iproute2, no netns...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the programs the testbed runs (iproute2 and util-linux)."""

    ip: str
    tc: str
    nsenter: str
    unshare: str
    mount: str


def find_tools() -> Tools | str:
    """The tools, or a one-line reason naming what is missing."""
    found: dict[str, str] = {}
    missing: list[str] = []
    # sbin is searched too: a non-login root shell may not have it on PATH.
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
    for name in ("ip", "tc", "nsenter", "unshare", "mount"):
        where = shutil.which(name, path=path)
        if where is None:
            missing.append(name)
        else:
            found[name] = where
    if missing:
        packages = sorted({"iproute2" if name in ("ip", "tc") else "util-linux" for name in missing})
        return f"missing {', '.join(missing)} (install {' and '.join(packages)})"
    return Tools(**found)


def command(argv: Sequence[str], *, timeout: float, what: str = "") -> str:
    """Run one command to completion within ``timeout`` seconds; its stdout, or TestbedError with its stderr."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as error:
        raise TestbedError(f"{what or ' '.join(argv)}: no answer within {timeout:g} s") from error
    except OSError as error:
        raise TestbedError(f"{what or ' '.join(argv)}: {error}") from error
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().replace("\n", "; ")
        raise TestbedError(f"{what or ' '.join(argv)}: exit {done.returncode}: {detail}")
    return done.stdout


@dataclass(frozen=True)
class RunName:
    """The name of one testbed: ``wst-<pid>-<start ticks>-<random>``; its namespaces add ``-h<i>``, ``-sw``."""

    name: str
    owner_pid: int
    owner_start: int

    @classmethod
    def new(cls) -> RunName:
        pid = os.getpid()
        start = process_start_ticks(pid) or 0
        return cls(f"{PREFIX}{pid}-{start}-{secrets.token_hex(3)}", pid, start)

    @classmethod
    def parse(cls, name: str) -> RunName | None:
        """The run a namespace or folder name belongs to, or None if the name is not the testbed's."""
        match = _RUN_RE.match(name)
        if match is None:
            return None
        return cls(match.group(1), int(match.group(2)), int(match.group(3)))

    def host_netns(self, index: int) -> str:
        return f"{self.name}-h{index}"

    @property
    def switch_netns(self) -> str:
        return f"{self.name}-sw"

    @property
    def probe_netns(self) -> str:
        return f"{self.name}-probe"


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count fields after its closing parenthesis.
    fields = text[text.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def owner_alive(run: RunName) -> bool:
    """Whether the process that built ``run`` still runs (same pid and the same start time)."""
    return process_start_ticks(run.owner_pid) == run.owner_start


def list_netns(tools: Tools, *, timeout: float) -> list[str]:
    """Names of all named network namespaces (``ip netns list``), ours or not."""
    out = command([tools.ip, "netns", "list"], timeout=timeout)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(tools: Tools, netns: str, *, timeout: float) -> list[int]:
    """Processes whose network namespace is ``netns`` (``ip netns pids``); empty if the namespace is gone."""
    try:
        out = command([tools.ip, "netns", "pids", netns], timeout=timeout)
    except TestbedError:
        return []
    return [int(token) for token in out.split() if token.isdigit()]


def kill_pids(pids: Sequence[int], *, timeout: float) -> None:
    """SIGKILL ``pids`` and wait (at most ``timeout`` s) until none is left; TestbedError if some survive."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    remaining = list(pids)
    while remaining and time.monotonic() < deadline:
        # A zombie whose parent is not us still has a /proc entry; its state letter is Z.
        remaining = [pid for pid in remaining if _running(pid)]
        if remaining:
            time.sleep(0.02)
    if remaining:
        raise TestbedError(f"processes {remaining} survived SIGKILL for {timeout:g} s")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    state = text[text.rfind(b")") + 2:][:1]
    return state not in (b"Z", b"X", b"")
