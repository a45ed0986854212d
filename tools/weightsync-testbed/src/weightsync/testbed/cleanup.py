"""Removing a run's namespaces, processes and files: the teardown of a live testbed and the sweep after a killed one.

Both go through :func:`remove_run`, so the path that runs after every test is the path that cleans up after a
``kill -9``. A run is found by its names alone (``wst-<pid>-<start>-<random>``): named network namespaces in
``ip netns list`` and a folder in the temporary directory. Nothing else of a run outlives its owner: the namespace
holders exit when their owner dies, taking every host process with them (see ``holder``), and the veth pairs and
the bridge exist only inside the run's namespaces, so they go when the namespaces are deleted.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from weightsync.testbed.system import (
    PREFIX,
    RunName,
    TestbedError,
    TestbedUnavailable,
    Tools,
    command,
    find_tools,
    kill_pids,
    list_netns,
    netns_pids,
    owner_alive,
)

__all__ = ["CleanupError", "CleanupReport", "cleanup", "remove_run", "run_folder"]


@dataclass
class CleanupReport:
    """What :func:`cleanup` removed, and the runs it left alone because their owner still runs."""

    removed_netns: list[str] = field(default_factory=list)
    removed_folders: list[str] = field(default_factory=list)
    killed_pids: list[int] = field(default_factory=list)
    live_runs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def removed_anything(self) -> bool:
        return bool(self.removed_netns or self.removed_folders or self.killed_pids)


class CleanupError(TestbedError):
    """Something could not be removed; ``report`` holds what was removed and what failed."""

    def __init__(self, report: CleanupReport) -> None:
        super().__init__("cleanup left something behind: " + "; ".join(report.errors))
        self.report = report


def run_folder(run: RunName) -> str:
    """The run's folder (its hosts file) in the temporary directory."""
    return os.path.join(tempfile.gettempdir(), run.name)


def remove_run(
    tools: Tools, run: RunName, netns_names: list[str], *, timeout: float, report: CleanupReport
) -> None:
    """Kill what runs in ``netns_names``, delete them, remove the run's folder; errors go to ``report.errors``.

    Processes are killed before the namespace is deleted: ``ip netns del`` only drops the name, and a process
    still inside would keep the namespace, its veth and its shaping alive, unseen.
    """
    deadline = time.monotonic() + timeout
    try:
        existing = set(list_netns(tools, timeout=_left(deadline)))
    except TestbedError as error:
        report.errors.append(str(error))
        return
    for netns in (name for name in netns_names if name in existing):  # a failed build may not have made them all
        for attempt in range(3):  # a process may fork while we kill its parent: look again, a bounded number of times
            pids = netns_pids(tools, netns, timeout=_left(deadline))
            if not pids:
                break
            try:
                kill_pids(pids, timeout=_left(deadline))
            except TestbedError as error:
                if attempt == 2:
                    report.errors.append(f"{netns}: {error}")
            report.killed_pids.extend(pids)
        try:
            command([tools.ip, "netns", "del", netns], timeout=_left(deadline), what=f"ip netns del {netns}")
            report.removed_netns.append(netns)
        except TestbedError as error:
            report.errors.append(str(error))
    folder = run_folder(run)
    if os.path.isdir(folder):
        try:
            shutil.rmtree(folder)
            report.removed_folders.append(folder)
        except OSError as error:
            report.errors.append(f"{folder}: {error}")


def cleanup(*, include_live: bool = False, timeout_s: float = 60.0) -> CleanupReport:
    """Remove the leftovers of testbeds whose owner process is gone (a killed run); return what was removed.

    ``include_live=True`` also removes testbeds whose owner still runs (their processes are killed): for a
    machine known to run no testbed. Raises TestbedUnavailable where the testbed's tools are missing, and
    CleanupError if something could not be removed (after trying everything else).
    """
    tools = find_tools()
    if isinstance(tools, str):
        raise TestbedUnavailable(tools)
    if os.geteuid() != 0:
        raise TestbedUnavailable(f"the testbed needs root (euid {os.geteuid()})")
    deadline = time.monotonic() + timeout_s
    runs: dict[str, tuple[RunName, list[str]]] = {}
    for netns in list_netns(tools, timeout=_left(deadline)):
        run = RunName.parse(netns)
        if run is not None:
            runs.setdefault(run.name, (run, []))[1].append(netns)
    for entry in os.listdir(tempfile.gettempdir()):
        run = RunName.parse(entry) if entry.startswith(PREFIX) else None
        if run is not None and run.name == entry:
            runs.setdefault(run.name, (run, []))
    report = CleanupReport()
    for run, netns_names in runs.values():
        if owner_alive(run) and not include_live:
            report.live_runs.append(run.name)
            continue
        remove_run(tools, run, sorted(netns_names), timeout=_left(deadline), report=report)
    if report.errors:
        raise CleanupError(report)
    return report


def _left(deadline: float) -> float:
    """Seconds left until ``deadline``, at least a little: a late step still gets a chance, bounded."""
    return max(1.0, deadline - time.monotonic())
