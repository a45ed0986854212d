"""The testbed: H hosts on one machine, each behind its own shaped link to one switch.

Layout of a run named ``wst-<pid>-<start>-<random>`` (``<run>`` below)::

    <run>-h0  eth0 198.18.0.1/24 ──veth── wst-h0 ┐
    <run>-h1  eth0 198.18.0.2/24 ──veth── wst-h1 ├─ wst-br   (all in the switch namespace <run>-sw)
    ...                                          ┘
              eth1 198.18.1.1/24 ──veth── wst-h0r1 ┐
              eth1 198.18.1.2/24 ──veth── wst-h1r1 ├─ wst-br1   (rail 1 of ``Testbed(rails=2)``, and so on)

Every interface lives in a namespace the run created (veths are created inside the switch namespace with their
peer placed straight into the host's), no host has a default route, and the bridge has no address, so no packet
can leave the run's namespaces: the machine's own interfaces, routes and ``/dev/shm`` are never touched.
Addresses come from 198.18.0.0/15 (RFC 2544, reserved for benchmarks); hosts of concurrent runs reuse them,
which is fine because runs share nothing.

A host is its named network namespace plus the mount, IPC, UTS and PID namespaces of its holder (see ``holder``).
Processes enter all five through ``nsenter`` (Python 3.11 has no ``os.setns``), so every process of a host shares
that host's private ``/dev/shm`` and no other host's. The node identity a process can read: its hostname
(``wst-h<i>``, resolvable through the host's own ``/etc/hosts``) and the environment variables in ``ENV_*``
(a distinct ``/proc/sys/kernel/random/boot_id`` per host is impossible: it is the machine's).

What hosts still share, by design: the machine's file system (the interpreter, the checkout and output files may
live anywhere) and its CPUs and memory. So a Unix socket bound to a *path* (not an abstract one: those belong to
the network namespace) could be reached from another host; a transport that did that would not cross the links,
and the link counters would show the bytes missing.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any

from typing_extensions import Self
from weightsync.testbed import links
from weightsync.testbed.cleanup import CleanupReport, remove_run, run_folder
from weightsync.testbed.holder import Holder, start_holder, wait_ready
from weightsync.testbed.links import MAX_RAILS, LinkCounters, LinkMode, Rail, rails_of, total
from weightsync.testbed.probe import probe
from weightsync.testbed.processes import HostProcess, reap
from weightsync.testbed.signals import deferred_signals, hold_exit_signals, release_exit_signals
from weightsync.testbed.system import RunName, TestbedError, TestbedUnavailable, Tools, command

__all__ = ["ENV_ADDR", "ENV_HOST", "ENV_HOSTS", "ENV_NODE_ID", "ENV_RAIL_ADDRS", "ENV_RUN", "Host", "Testbed"]

ENV_HOST = "WEIGHTSYNC_TESTBED_HOST"  # the host's index, 0..H-1
ENV_HOSTS = "WEIGHTSYNC_TESTBED_HOSTS"  # H
ENV_NODE_ID = "WEIGHTSYNC_TESTBED_NODE_ID"  # unique per host and run: the host's network namespace name
ENV_ADDR = "WEIGHTSYNC_TESTBED_ADDR"  # the host's address on the testbed (rail 0's)
# The host's address on each rail, comma-separated, rail 0 first: what weightsync's workers read to find their rail
# (weightsync.core.transports.place.RAIL_ADDRS_ENV), as a deployment would set it.
ENV_RAIL_ADDRS = "WEIGHTSYNC_RAIL_ADDRS"
ENV_RUN = "WEIGHTSYNC_TESTBED_RUN"  # the run's name

MAX_HOSTS = 250
STEP_TIMEOUT_S = 15.0

_open_testbeds: set[Testbed] = set()
_atexit_lock = threading.Lock()
_atexit_registered = False


@dataclass(frozen=True)
class Host:
    """One emulated host: ``netns`` is its network namespace, ``rails`` its links (rail 0's ``address`` and
    ``switch_port``, its end in the switch, are also ``address`` and ``switch_port``)."""

    index: int
    hostname: str
    address: str
    netns: str
    switch_port: str
    rails: tuple[Rail, ...] = ()


class Testbed:
    """H hosts joined by links of ``link_gbps`` each way, ``rails`` links per host (each its own network); a
    context manager (or ``start()`` / ``close()``).

    >>> with Testbed(3, link_gbps=2.0) as testbed:                              # doctest: +SKIP
    ...     before = testbed.counters()
    ...     server = testbed.popen(1, [sys.executable, "-m", "my.receiver"])
    ...     testbed.run(0, [sys.executable, "-m", "my.sender", testbed.hosts[1].address], timeout=60)
    ...     sent = testbed.counters()[0] - before[0]                            # host 0's egress, on its link

    ``rtt_ms``: round-trip delay between any two hosts (needs sch_netem). ``shm_bytes``: size of each host's
    ``/dev/shm`` (default: the kernel's, half of RAM). ``lifetime_s``: hosts remove themselves after this long even
    if the owner never closes (it may hang); they also go when the owner process dies. Everything is removed on
    ``close()``, on leaving the ``with`` block (error or not), on Ctrl-C/SIGTERM/SIGHUP, at interpreter exit; after
    a ``kill -9``, :func:`~weightsync.testbed.cleanup` removes what is left. Needs root, iproute2, util-linux:
    where the machine cannot host it, ``start()`` raises TestbedUnavailable with the reason.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self,
        hosts: int,
        *,
        link_gbps: float,
        rails: int = 1,
        rtt_ms: float = 0.0,
        mtu: int = 1500,
        shm_bytes: int | None = None,
        lifetime_s: float = 24 * 3600.0,
    ) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be 1..{MAX_HOSTS}, got {hosts}")
        if not 0.001 <= link_gbps <= 400:
            raise ValueError(f"link_gbps must be 0.001..400, got {link_gbps}")
        if isinstance(rails, bool) or not isinstance(rails, int) or not 1 <= rails <= MAX_RAILS:
            raise ValueError(f"rails must be an int 1..{MAX_RAILS}, got {rails!r}")
        if not 0 <= rtt_ms <= 10_000:
            raise ValueError(f"rtt_ms must be 0..10000, got {rtt_ms}")
        if not 576 <= mtu <= 65_535:
            raise ValueError(f"mtu must be 576..65535, got {mtu}")
        if shm_bytes is not None and shm_bytes <= 0:
            raise ValueError(f"shm_bytes must be positive (or None for the kernel's default), got {shm_bytes}")
        if lifetime_s <= 0:
            raise ValueError(f"lifetime_s must be positive, got {lifetime_s}")
        self.link_gbps = link_gbps
        self.rails = rails
        self.rtt_ms = rtt_ms
        self.mtu = mtu
        self.shm_bytes = shm_bytes
        self.lifetime_s = lifetime_s
        self.run_name = RunName.new()
        self.hosts = tuple(
            Host(index=i, hostname=f"wst-h{i}", address=ports[0].address, netns=self.run_name.host_netns(i),
                 switch_port=ports[0].switch_port, rails=ports)
            for i, ports in ((i, rails_of(i, rails)) for i in range(hosts))
        )
        self.switch_netns = self.run_name.switch_netns
        self._tools: Tools | None = None
        self._holders: dict[int, Holder] = {}
        self._processes: list[HostProcess] = []
        self._down: dict[tuple[int, int], LinkMode] = {}  # (host, rail) → how it is down
        self._lock = threading.Lock()
        self._state = "new"  # new → started → closed

    # ----- lifecycle -----

    def __enter__(self) -> Self:
        """Start the testbed, unless ``start()`` already did: the block then owns its teardown either way."""
        if self._state == "started":
            return self
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        _close_keeping(self, exc)

    def start(self) -> Self:
        """Build every namespace, link and host; TestbedUnavailable where the machine cannot, TestbedError else."""
        if self._state != "new":
            raise TestbedError(f"testbed {self.run_name.name} was already started")
        capabilities = probe()
        if capabilities.reason is not None or capabilities.tools is None:
            raise TestbedUnavailable(capabilities.reason or "the testbed's tools are missing")
        if self.rtt_ms > 0 and not capabilities.netem:
            raise TestbedUnavailable("an RTT needs sch_netem, which this kernel lacks (CONFIG_NET_SCH_NETEM)")
        self._tools = capabilities.tools
        self._state = "started"
        _track(self)
        hold_exit_signals()
        try:
            self._build(self._tools)
        except BaseException as error:
            _close_keeping(self, error)
            raise
        return self

    def close(self, *, grace_s: float = 1.0) -> None:
        """Remove everything: processes get SIGTERM and ``grace_s`` seconds, then every host is killed.

        Idempotent. Ctrl-C and SIGTERM are held back until it is done. TestbedError if something remains.
        """
        with self._lock:
            if self._state != "started":
                self._state = "closed"
                return
            self._state = "closed"
        report = CleanupReport()
        try:
            with deferred_signals():
                self._teardown(grace_s, report)
        finally:
            release_exit_signals()
            _open_testbeds.discard(self)
        if report.errors:
            raise TestbedError(f"teardown of {self.run_name.name} left something: " + "; ".join(report.errors))

    @property
    def started(self) -> bool:
        return self._state == "started"

    # ----- processes -----

    def env(self, host: int) -> dict[str, str]:
        """The identity variables every process of ``host`` gets (ENV_* names)."""
        entry = self._host(host)
        return {ENV_RUN: self.run_name.name, ENV_HOST: str(entry.index), ENV_HOSTS: str(len(self.hosts)),
                ENV_NODE_ID: entry.netns, ENV_ADDR: entry.address,
                ENV_RAIL_ADDRS: ",".join(rail.address for rail in entry.rails)}

    def popen(
        self,
        host: int,
        argv: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
    ) -> HostProcess:
        """Start ``argv`` in ``host`` (bytes pipes, as subprocess.Popen); it is killed at teardown if still running.

        ``env`` is the whole environment as for subprocess (None: this process's); the host's identity variables
        are added to it. ``cwd`` defaults to this process's working directory (the file system is the machine's).
        """
        tools = self._started_tools()
        entry = self._host(host)
        holder = self._live_holder(entry)
        workdir = os.fspath(cwd) if cwd is not None else os.getcwd()
        wrapped = [tools.nsenter, f"--target={holder.pid}", "--net", "--mount", "--ipc", "--uts", "--pid",
                   f"--wd={workdir}", "--", *(os.fspath(arg) for arg in argv)]
        environment = dict(os.environ if env is None else env)
        environment.update(self.env(host))
        process = HostProcess(wrapped, stdin=stdin, stdout=stdout, stderr=stderr, env=environment,
                              start_new_session=True)
        process.host = host
        with self._lock:
            self._processes = [p for p in self._processes if p.poll() is None]
            self._processes.append(process)
        return process

    def run(
        self,
        host: int,
        argv: Sequence[str | os.PathLike[str]],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        input: bytes | None = None,
        timeout: float = 60.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` in ``host`` to completion, output captured; killed after ``timeout`` (TimeoutExpired).

        ``check``: a non-zero exit raises CalledProcessError, as ``subprocess.run(check=True)``.
        """
        process = self.popen(host, argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        with process:
            try:
                out, err = process.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate(timeout=STEP_TIMEOUT_S)
                raise
        completed = subprocess.CompletedProcess([os.fspath(arg) for arg in argv], process.returncode, out, err)
        if check:
            completed.check_returncode()
        return completed

    # ----- links -----

    def counters(self) -> tuple[LinkCounters, ...]:
        """Every host's counters now over all its rails, indexed by host (read in the switch namespace)."""
        return tuple(total(rails) for rails in self.rail_counters())

    def rail_counters(self) -> tuple[tuple[LinkCounters, ...], ...]:
        """Every host's counters now, per rail: ``[host][rail]`` (read in the switch namespace: see ``links``)."""
        tools = self._started_tools()
        out = command([tools.ip, "-n", self.switch_netns, "-j", "-s", "link", "show"], timeout=STEP_TIMEOUT_S,
                      what="reading link counters")
        found = links.parse_counters(out, {rail.switch_port: (entry.index, rail.index)
                                           for entry in self.hosts for rail in entry.rails})
        missing = [(entry.index, rail.index) for entry in self.hosts for rail in entry.rails
                   if (entry.index, rail.index) not in found]
        if missing:
            raise TestbedError(f"no link counters for (host, rail) {missing} in {self.switch_netns}")
        return tuple(tuple(found[entry.index, rail.index] for rail in entry.rails) for entry in self.hosts)

    def link_down(self, host: int, *, rail: int | None = None, mode: LinkMode = "drop") -> None:
        """Cut ``host``'s rail ``rail`` (None: every rail) both ways: ``drop`` (every packet dropped, carrier kept)
        or ``carrier`` (veth down)."""
        entry = self._host(host)
        tools = self._started_tools()
        if mode not in ("drop", "carrier"):
            raise ValueError(f"mode must be 'drop' or 'carrier', got {mode!r}")
        with self._lock:
            cut = self._rails(entry, rail)
            already = [port.index for port in cut if (host, port.index) in self._down]
            if already:
                raise TestbedError(f"host {host}'s rail {already[0]} is already down "
                                   f"({self._down[host, already[0]]})")
            for port in cut:
                if mode == "drop":
                    argvs = [*links.blackhole_commands(tools.tc, self.switch_netns, port.switch_port),
                             *links.blackhole_commands(tools.tc, entry.netns, port.device)]
                else:
                    argvs = [[tools.ip, "-n", self.switch_netns, "link", "set", port.switch_port, "down"]]
                for argv in argvs:
                    command(argv, timeout=STEP_TIMEOUT_S, what=f"taking host {host}'s rail {port.index} down")
                self._down[host, port.index] = mode

    def link_up(self, host: int, *, rail: int | None = None) -> None:
        """Restore ``host``'s rail ``rail`` (None: every rail) as it was built (no-op where it is up)."""
        entry = self._host(host)
        tools = self._started_tools()
        with self._lock:
            for port in self._rails(entry, rail):
                mode = self._down.get((host, port.index))
                if mode == "carrier":
                    command([tools.ip, "-n", self.switch_netns, "link", "set", port.switch_port, "up"],
                            timeout=STEP_TIMEOUT_S, what=f"bringing host {host}'s rail {port.index} up")
                elif mode == "drop":
                    self._shape(tools, entry, port)
                self._down.pop((host, port.index), None)

    def link_is_up(self, host: int, *, rail: int | None = None) -> bool:
        """Whether ``host``'s rail ``rail`` (None: every rail of it) is up."""
        return not any((host, port.index) in self._down for port in self._rails(self._host(host), rail))

    # ----- internals -----

    def _host(self, host: int) -> Host:
        if not 0 <= host < len(self.hosts):
            raise ValueError(f"host must be 0..{len(self.hosts) - 1}, got {host}")
        return self.hosts[host]

    def _rails(self, entry: Host, rail: int | None) -> tuple[Rail, ...]:
        if rail is None:
            return entry.rails
        if isinstance(rail, bool) or not isinstance(rail, int) or not 0 <= rail < len(entry.rails):
            raise ValueError(f"rail must be 0..{len(entry.rails) - 1} (or None: every rail), got {rail!r}")
        return (entry.rails[rail],)

    def _started_tools(self) -> Tools:
        if self._state != "started" or self._tools is None:
            raise TestbedError(f"testbed {self.run_name.name} is {self._state}, not started")
        return self._tools

    def _live_holder(self, entry: Host) -> Holder:
        holder = self._holders.get(entry.index)
        if holder is None or not holder.alive():
            raise TestbedError(f"host {entry.index} ({entry.netns}) is gone: its namespace holder has exited")
        return holder

    def _shape(self, tools: Tools, entry: Host, rail: Rail) -> None:
        for argv in [
            # Host egress carries the delay (RTT/2 each way between two hosts); the switch side only shapes.
            *links.shaping_commands(tools.tc, entry.netns, rail.device, link_gbps=self.link_gbps,
                                    delay_ms=self.rtt_ms / 2, mtu=self.mtu),
            *links.shaping_commands(tools.tc, self.switch_netns, rail.switch_port, link_gbps=self.link_gbps,
                                    delay_ms=0.0, mtu=self.mtu),
        ]:
            command(argv, timeout=STEP_TIMEOUT_S, what=f"shaping host {entry.index}'s rail {rail.index}")

    def _build(self, tools: Tools) -> None:
        folder = run_folder(self.run_name)
        os.makedirs(folder, mode=0o755)
        hosts_file = os.path.join(folder, "hosts")
        with open(hosts_file, "w") as out:
            out.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            out.writelines(f"{entry.address}\t{entry.hostname}\n" for entry in self.hosts)
        steps = links.build_commands(tools.ip, self.switch_netns, [(entry.netns, entry.rails) for entry in self.hosts],
                                     mtu=self.mtu)
        for argv in steps:
            command(argv, timeout=STEP_TIMEOUT_S, what=f"building {self.run_name.name}: {' '.join(argv[1:])}")
        for entry in self.hosts:
            for rail in entry.rails:
                self._shape(tools, entry, rail)
        started = {entry.index: start_holder(tools, entry.netns, hostname=entry.hostname, hosts_file=hosts_file,
                                             shm_bytes=self.shm_bytes, lifetime_s=self.lifetime_s)
                   for entry in self.hosts}
        deadline = time.monotonic() + 20.0 + len(self.hosts)
        for index, process in started.items():
            # Registered before waiting, so that a failure here still has every holder to kill.
            self._holders[index] = Holder(process=process, pid=-1, start_ticks=None)
        for index, process in started.items():
            self._holders[index] = wait_ready(process, what=f"host {index}", deadline=deadline)

    def _teardown(self, grace_s: float, report: CleanupReport) -> None:
        with self._lock:
            processes = [p for p in self._processes if p.poll() is None]
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + grace_s
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for holder in self._holders.values():
            # pid 1 of the host: the kernel kills every process left in the host with it.
            if holder.pid > 0 and holder.alive():
                try:
                    os.kill(holder.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if holder.process.stdin is not None:
                holder.process.stdin.close()  # a holder not yet ready exits on EOF
            reap(holder.process, report)
        for process in processes:
            reap(process, report)
        if self._tools is not None:
            netns = [self.switch_netns, *(entry.netns for entry in self.hosts)]
            remove_run(self._tools, self.run_name, netns, timeout=STEP_TIMEOUT_S * 2, report=report)


def _close_keeping(testbed: Testbed, error: BaseException) -> None:
    """Close while ``error`` propagates: a teardown failure is added to it as a note rather than replacing it."""
    try:
        testbed.close()
    except TestbedError as teardown_error:
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"testbed teardown also failed: {teardown_error}")


def _track(testbed: Testbed) -> None:
    global _atexit_registered
    with _atexit_lock:
        _open_testbeds.add(testbed)
        if not _atexit_registered:
            atexit.register(_close_all)
            _atexit_registered = True


def _close_all() -> None:
    for testbed in list(_open_testbeds):
        try:
            testbed.close()
        except TestbedError as error:
            print(f"weightsync testbed: {error}", flush=True)
