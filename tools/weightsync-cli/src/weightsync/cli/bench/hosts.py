"""``weightsync bench --hosts H``: the same cases across an emulated testbed (``weightsync.testbed``).

The bench builds the testbed itself and removes it when done (on error and Ctrl-C too): H hosts, each behind its
own link shaped to ``--link-gbps`` both ways. The sender runs on host 0 and ``--receivers`` rollout workers on each
of hosts 1..H-1; every worker is a process inside its host (forked there by the host's fork server: ``forks``),
speaking the bench's worker protocol over a socket, and advertising its host's node id and address (198.18.x.x), so the
control plane and every transport run over the testbed's links.

Why the bytes must cross the links, and how we know they do: hosts share no ``/dev/shm``, no IPC and no PID
namespace, so shared memory and cross-memory attach cannot reach another host's memory (see the testbed's
``holder``); backends whose spec says they cannot cross nodes (shm) are left out and listed as skipped. The link
counters, read outside every host around each timed update, give the bytes host 0 sent and each receiving host
received: a full update must show at least S on each.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from weightsync.api.registry import get_backend_spec
from weightsync.cli.bench.forks import FORK_SERVER_ARGV, HostForks
from weightsync.cli.bench.measure import Placement, PlacementUnavailable, Spawned
from weightsync.cli.bench.scenario import BenchOptions
from weightsync.core.control.auto import AUTO
from weightsync.testbed import CleanupError, LinkCounters, Testbed, TestbedUnavailable, cleanup

__all__ = ["HostPlacement", "cross_host_split", "placement", "run_cleanup"]


class HostPlacement:
    """Workers forked inside the hosts of a running testbed, from one fork server per host (``forks``)."""

    testbed = True

    def __init__(self, testbed: Testbed) -> None:
        self.bed = testbed
        self.rails = testbed.rails
        self.forks: dict[int, HostForks] = {}

    def _forks(self, host: int) -> HostForks:
        if host not in self.forks:
            ours, theirs = HostForks.pair()
            try:
                self.bed.popen(host, FORK_SERVER_ARGV, stdin=theirs.fileno())
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self.forks[host] = HostForks(ours)
        return self.forks[host]

    def start(self, spec: dict[str, Any], *, host: int) -> Spawned:
        forks = self._forks(host)
        channel, pid = forks.fork()
        channel.send_bytes(json.dumps(spec).encode())

        def stop(timeout: float) -> None:
            try:
                forks.reap(pid, timeout)
            finally:
                channel.close()

        return Spawned(channel, stop)

    def read_links(self) -> Sequence[Sequence[LinkCounters]]:
        return self.bed.rail_counters()

    def close(self) -> None:
        """Close every host's fork server (each kills what it still runs and exits; teardown kills the rest)."""
        for forks in self.forks.values():
            forks.close()
        self.forks.clear()


def cross_host_split(backends: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The backends that can cross hosts, and those that cannot (their spec's ``cross_node`` is False; ``auto``
    crosses: it picks a backend that does)."""
    crossing = tuple(name for name in backends if name == AUTO or get_backend_spec(name).cross_node)
    return crossing, tuple(name for name in backends if name not in crossing)


@contextlib.contextmanager
def placement(options: BenchOptions) -> Iterator[Placement]:
    """A testbed of ``options.hosts`` hosts built for the block and removed after it; PlacementUnavailable (with the
    testbed's one-line reason) where this machine cannot host one."""
    try:
        with Testbed(options.hosts, link_gbps=options.link_gbps, rails=options.rails,
                     rtt_ms=options.rtt_ms) as testbed:
            hosts = HostPlacement(testbed)
            try:
                yield hosts
            finally:
                hosts.close()
    except TestbedUnavailable as error:
        raise PlacementUnavailable(f"no testbed on this machine: {error.reason}") from error


def run_cleanup() -> int:
    """``weightsync bench --cleanup``: remove what killed testbed runs left (runs whose owner lives are kept)."""
    try:
        report = cleanup()
    except TestbedUnavailable as error:
        print(f"weightsync bench --cleanup: no testbed on this machine: {error.reason}", file=sys.stderr)
        return 2
    except CleanupError as error:
        print(f"weightsync bench --cleanup: {error}", file=sys.stderr)
        return 1
    removed = len(report.removed_netns) + len(report.removed_folders)
    print(f"removed {len(report.removed_netns)} namespaces, {len(report.removed_folders)} folders and "
          f"{len(report.killed_pids)} processes of killed testbed runs" if removed or report.killed_pids
          else "nothing to remove: no leftovers of a killed testbed run")
    for netns in report.removed_netns:
        print(f"  {netns}")
    if report.live_runs:
        print(f"left alone (their owner still runs): {', '.join(report.live_runs)}")
    return 0
