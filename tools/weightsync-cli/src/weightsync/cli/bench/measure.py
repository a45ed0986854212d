"""Timing one case: 1 sender + R receivers spawned (see ``worker``), connected, and whole updates timed after a
warm-up; in the ``bucketed`` processes also the two yardsticks (a raw gloo broadcast, this host's copy bandwidth).

Where the processes run is a ``Placement``: this machine (``LocalPlacement``, the default) or the hosts of an
emulated testbed (``weightsync.cli.bench.hosts``), whose link counters are then read around every timed update.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from weightsync.api.config import MiB
from weightsync.api.types import UpdateReport
from weightsync.cli.bench.managed import ManagedUpdates, report_dict
from weightsync.cli.bench.scenario import BASELINES, Case, bench_part
from weightsync.cli.bench.sharded import check_receivers
from weightsync.cli.bench.worker import Channel, c10d, serve
from weightsync.cli.progress import Progress
from weightsync.core.transports.place import default_node_id

if TYPE_CHECKING:  # the testbed is an extra of the CLI (weightsync-cli[testbed]): only ``hosts`` imports it
    from weightsync.testbed import LinkCounters

__all__ = ["COPY_TRIES", "RAW_TRIES", "BenchResult", "LocalPlacement", "Placement", "PlacementUnavailable",
           "ServingFigures", "Spawned", "Yardsticks", "cores", "measure_case"]

COPY_BYTES = 256 * MiB
COPY_TRIES = 5
RAW_TRIES = 3


@dataclass(frozen=True)
class BenchResult:
    backend: str
    gbps_p50: float
    gbps_p90: float
    peak_extra_rss_mb: float
    seconds: list[float]
    sender_egress_bytes: list[int] = field(default_factory=list)
    """Per timed update (testbed only): bytes host 0 sent on its link."""
    host_ingress_bytes: list[list[int]] = field(default_factory=list)
    """Per timed update (testbed only): bytes each of hosts 1..H-1 received on its link."""
    rail_egress_bytes: list[list[int]] = field(default_factory=list)
    """Per timed update (testbed only): bytes host 0 sent on each of its rails."""
    rail_ingress_bytes: list[list[list[int]]] = field(default_factory=list)
    """Per timed update (testbed only): for each of hosts 1..H-1, bytes it received on each of its rails."""
    chosen: str = ""
    """For ``auto``: the backend (and layout) it picked for this placement."""
    report: dict[str, Any] | None = None
    """An engine entry's: the manager's ``UpdateReport`` of its last timed update, as plain data."""
    serving: ServingFigures | None = None
    """``--staged``: what the receivers' serving loops saw."""
    busy_seconds: list[float] = field(default_factory=list)
    """An engine entry's, per timed update: the receivers' busy seconds (each receiver's ``unpack`` phase, their
    median): what reading, copying and hashing an update cost a receiver."""
    receivers_rss_mb: float = 0.0
    """The receivers' peak extra RSS (the largest of theirs), MiB: what a receiver keeps (``--delta``: its copies)."""
    checked: int = 0
    """``--sharded``: the receivers whose whole model was compared with the version sent last, after the timed
    updates, and held it bit for bit (every receiver: a mismatch fails the run)."""


@dataclass
class ServingFigures:
    """``--staged``: measured inside the receivers (``weightsync.cli.bench.serving``), per timed update."""

    idle_rate: float
    """Forward passes per second of one receiver serving undisturbed (the median receiver, over one second)."""
    pause_ms: list[float] = field(default_factory=list)
    """The longest pause of any receiver: the last pass before it to the first after it."""
    apply_ms: list[float] = field(default_factory=list)
    """A staged entry's: the longest apply from staging into the model."""
    served_during_stage: list[int] = field(default_factory=list)
    """A staged entry's: passes the median receiver completed while the update was being staged."""
    stage_seconds: list[float] = field(default_factory=list)
    failed_requests: int = 0


@dataclass
class Yardsticks:
    raw_gloo_seconds: float = math.inf
    copy_bandwidth: float = 0.0  # bytes copied per second by k processes together, Tensor.copy_
    engine_copy_bandwidth: float = 0.0  # the same with the engines' own copy (copy_stream) in 256 KiB pieces
    copiers: int = 0


@dataclass
class Spawned:
    """A started worker: its command channel, and ``stop(timeout)``, which waits that long for it to exit, then
    kills it."""

    channel: Channel
    stop: Callable[[float], None]


class Placement(Protocol):
    """Where a case's workers run."""

    testbed: bool
    """Workers on testbed hosts: they find their own identity; group rank 0 hosts the baselines' store."""
    rails: int
    """Links per host (a worker's rail: its local rank mod this)."""

    def start(self, spec: dict[str, Any], *, host: int) -> Spawned:
        """Start one worker serving ``spec`` on ``host`` (ignored on this machine)."""
        ...

    def read_links(self) -> Sequence[Sequence[LinkCounters]] | None:
        """Every host's link counters now, per rail (``[host][rail]``); None where there are no links."""
        ...


class PlacementUnavailable(RuntimeError):
    """This machine cannot place the workers as asked (``--hosts``: it cannot host the testbed); the message says
    why in one line."""


class LocalPlacement:
    """Every worker a ``multiprocessing`` child on this machine, over a ``Pipe``: forked from a server that imported
    the worker once (``forkserver``, the module preloaded), not spawned: a spawned worker spends about two seconds of
    CPU importing torch before its first command, and a bench starts one per rank for every entry."""

    testbed = False
    rails = 1

    def start(self, spec: dict[str, Any], *, host: int) -> Spawned:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["weightsync.cli.bench.worker"])
        parent, child = context.Pipe()
        process = context.Process(target=serve, args=(child, spec), daemon=True)
        process.start()
        child.close()

        def stop(timeout: float) -> None:
            process.join(timeout)
            if process.is_alive():
                process.kill()

        return Spawned(parent, stop)

    def read_links(self) -> Sequence[Sequence[LinkCounters]] | None:
        return None


class _Workers:
    """1 + R spawned workers of one case; ``all_do`` sends one command to each and waits for every reply."""

    def __init__(self, case: Case, placement: Placement) -> None:
        self.name = case.name
        self.placement = placement
        self.store: Any = None
        common: dict[str, Any] = {"layout": case.layout, "bucket_bytes": case.bucket_bytes,
                                  "node_id": default_node_id(), "testbed": placement.testbed,
                                  "versions": case.versions}
        if case.name in BASELINES:
            common.update(kind=case.name, group_size=1 + case.receivers, tag=secrets.token_hex(8))
            if not placement.testbed:
                # The driver hosts the baselines' store, bound to the loopback interface only.
                self.store = c10d.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
                common.update(store_host="127.0.0.1", store_port=int(self.store.port))
        else:
            common.update(kind="engine")  # its engine is the manager's to build (weightsync.cli.bench.managed)
        if case.source:
            # ``--sharded``: the actor ranks' own gloo group (FSDP2's), over a store the driver hosts on the loopback
            # (on a testbed actor rank 0's: ``join_actors``).
            common.update(source=case.source, actor_ranks=case.actors, tag=secrets.token_hex(8))
            if not placement.testbed:
                self.store = c10d.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
                common.update(store_host="127.0.0.1", store_port=int(self.store.port))
        self.pipes: list[Channel] = []
        self.stops: list[Callable[[float], None]] = []
        self.actors = case.actors
        part_of = {rank: index for replica in case.replicas() for index, rank in enumerate(replica)}
        for group_rank in range(case.actors + case.receivers):
            role, rank = ("actor", group_rank) if group_rank < case.actors else ("rollout", group_rank - case.actors)
            spec = {**common, "role": role, "rank": rank, "group_rank": group_rank,
                    "local_rank": case.local_rank(group_rank)}
            if case.parts and role == "rollout":  # worker k of its replica holds part k
                spec["part"] = bench_part(case.layout, case.parts, part_of[group_rank]).to_dict()
            spawned = placement.start(spec, host=case.host_of(group_rank))
            self.pipes.append(spawned.channel)
            self.stops.append(spawned.stop)
        if case.source and placement.testbed:
            self.join_actors()

    def join_actors(self) -> None:
        """``--sharded`` on a testbed: the driver is unreachable from the hosts, so actor rank 0 hosts the FSDP2
        group's store on its host's address (every actor rank shares host 0), and then every actor rank joins."""
        store = self.all_do([{"op": "store"}], self.pipes[:1])[0]
        self.all_do([{"op": "join", **store}] * self.actors, self.pipes[:self.actors])

    def all_do(self, commands: list[dict[str, Any]], pipes: list[Channel] | None = None) -> list[Any]:
        targets = self.pipes if pipes is None else pipes
        for pipe, command in zip(targets, commands):
            pipe.send_bytes(json.dumps(command).encode())
        replies = []
        for index, pipe in enumerate(targets):
            try:
                replies.append(json.loads(pipe.recv_bytes()))
            except EOFError:
                raise RuntimeError(f"{self.name}: worker {index} died (see its traceback above)") from None
        return replies

    def each(self, op: str, **fields: Any) -> list[Any]:
        return self.all_do([{"op": op, **fields}] * len(self.pipes))

    def each_receiver(self, op: str, **fields: Any) -> list[Any]:
        """``each`` for the receivers only (group ranks A..A+R-1)."""
        return self.all_do([{"op": op, **fields}] * (len(self.pipes) - self.actors), self.pipes[self.actors:])

    def connect(self) -> None:
        """A baseline's group: every worker joins it."""
        if self.placement.testbed:
            # On a testbed the driver is unreachable: group rank 0 hosts the store on its host's address.
            store = self.all_do([{"op": "store"}], self.pipes[:1])[0]
            self.each("init", **store)
        else:
            self.each("init")

    def update(self, serving: ServingFigures | None) -> float:
        """A baseline's update: every worker's part at once; its seconds. With ``serving`` every receiver is paused
        around it, and its pause goes there."""
        lasts = self.each_receiver("pause") if serving is not None else []
        started = time.perf_counter()
        self.each("run")
        seconds = time.perf_counter() - started
        if serving is not None:
            self.record_pauses(serving, lasts, self.each_receiver("resume"))
        return seconds

    def record_pauses(self, serving: ServingFigures, lasts: list[float], marks: list[int]) -> None:
        """The longest pause of any receiver: its last pass before the pause (``lasts``) to its first after the
        resume (the pass counts at the resumes: ``marks``)."""
        firsts = self.all_do([{"op": "first_after", "mark": mark} for mark in marks], self.pipes[self.actors:])
        serving.pause_ms.append(max(first - last for first, last in zip(firsts, lasts)) * 1e3)

    def close(self) -> None:
        try:
            self.each("close")
        except (RuntimeError, OSError):
            pass
        finally:
            for stop in self.stops:
                stop(10.0)


def measure_case(case: Case, progress: Progress, trace: list[dict[str, Any]] | None = None,
                 yardsticks: Yardsticks | None = None, placement: Placement | None = None) -> BenchResult:
    """Time ``case.repeat`` updates after a warm-up; with ``trace``, add one traced update's events to it; with
    ``yardsticks``, measure them in the same processes afterwards. ``placement``: where the workers run (default:
    this machine); where it has links, their counters are read before and after every timed update (untimed). An
    engine entry's updates are the manager's (``weightsync.cli.bench.managed``), a baseline's the workers' own."""
    placement = placement or LocalPlacement()
    workers = _Workers(case, placement)
    managed = ManagedUpdates(case, workers) if case.name not in BASELINES else None
    updates = managed or workers
    links = _LinkBytes()
    serving: ServingFigures | None = None
    try:
        updates.connect()
        if case.serving:
            serving = _start_serving(workers)
        workers.each("mark")
        workers.each("load", version=0)
        updates.update(None)
        progress.step(f"{case.name}: warm-up")
        seconds, busy = [], []
        for index in range(case.repeat):
            workers.each("load", version=index + 1)
            before = placement.read_links()
            seconds.append(updates.update(serving))
            if managed is not None and managed.report is not None:
                busy.append(receivers_busy(managed.report))
            after = placement.read_links()
            if before is not None and after is not None:
                links.add(before, after)
            progress.step(f"{case.name}: update {index + 1}/{case.repeat}")
        # Taken before any yardstick (or check) allocates: the peak over the updates only.
        peak_extra = max(workers.each("rss")) / MiB
        receivers_rss = max(workers.each_receiver("rss"), default=0) / MiB
        checked = 0
        if case.source:  # ``--sharded``: every receiver holds the version sent last, bit for bit
            checked = check_receivers(case.name, workers.each_receiver("check", version=case.repeat))
        if serving is not None:
            serving.failed_requests = sum(workers.each_receiver("failed"))
        report = report_dict(managed.report) if managed is not None else None
        if trace is not None and managed is not None:
            _trace_update(managed, workers, case, progress, trace)
        if yardsticks is not None:
            _measure_yardsticks(workers, case, progress, yardsticks)
    finally:
        if managed is not None:
            managed.close()
        workers.close()
    rates = sorted(case.total_bytes / s / 1e9 for s in seconds)
    p90 = rates[max(0, round(0.1 * (len(rates) - 1)))]  # 90% of the updates were at least this fast
    return BenchResult(backend=case.name, gbps_p50=statistics.median(rates), gbps_p90=p90,
                       peak_extra_rss_mb=peak_extra, seconds=seconds, sender_egress_bytes=links.egress,
                       host_ingress_bytes=links.ingress, rail_egress_bytes=links.rail_egress,
                       rail_ingress_bytes=links.rail_ingress, chosen=managed.chosen if managed else "",
                       serving=serving, report=report, busy_seconds=busy, checked=checked,
                       receivers_rss_mb=receivers_rss)


def receivers_busy(report: UpdateReport) -> float:
    """The median receiver's busy seconds in ``report``: its consumer's time with a bucket in hand (``unpack``)."""
    return statistics.median(phase.seconds for transfer in report.transfers if transfer.role == "rollout"
                             for phase in transfer.phases if phase.phase == "unpack")


@dataclass
class _LinkBytes:
    """What the links carried in each timed update: host 0's egress and each receiving host's ingress, in all and
    per rail."""

    egress: list[int] = field(default_factory=list)
    ingress: list[list[int]] = field(default_factory=list)
    rail_egress: list[list[int]] = field(default_factory=list)
    rail_ingress: list[list[list[int]]] = field(default_factory=list)

    def add(self, before: Sequence[Sequence[LinkCounters]], after: Sequence[Sequence[LinkCounters]]) -> None:
        delta = [[later - earlier for later, earlier in zip(now, then)] for now, then in zip(after, before)]
        self.rail_egress.append([rail.egress_bytes for rail in delta[0]])
        self.rail_ingress.append([[rail.ingress_bytes for rail in host] for host in delta[1:]])
        self.egress.append(sum(self.rail_egress[-1]))
        self.ingress.append([sum(host) for host in self.rail_ingress[-1]])


IDLE_SECONDS = 1.0


def _start_serving(workers: _Workers) -> ServingFigures:
    """Every receiver starts serving; its idle rate is counted over ``IDLE_SECONDS`` undisturbed."""
    workers.each_receiver("serve")
    time.sleep(0.2)  # past the first passes
    start = time.monotonic()
    time.sleep(IDLE_SECONDS)
    counts = workers.each_receiver("count", start=start, end=time.monotonic())
    return ServingFigures(idle_rate=statistics.median(counts) / IDLE_SECONDS)


def _trace_update(managed: ManagedUpdates, workers: _Workers, case: Case, progress: Progress,
                  trace: list[dict[str, Any]]) -> None:
    workers.each("load", version=case.repeat + 1)
    started = time.perf_counter()
    trace.extend(managed.traced(None))
    trace.append({"name": f"update ({case.name})", "cat": "update", "ph": "X", "ts": started * 1e6,
                  "dur": (time.perf_counter() - started) * 1e6, "pid": "driver", "tid": "main"})
    progress.step(f"{case.name}: traced update")


def _measure_yardsticks(workers: _Workers, case: Case, progress: Progress, yardsticks: Yardsticks) -> None:
    workers.each("raw_setup", nbytes=case.total_bytes)
    workers.each("raw")  # warm-up: gloo's first broadcast of a new size sets up its pairs' buffers
    for _ in range(RAW_TRIES):
        started = time.perf_counter()
        workers.each("raw")
        yardsticks.raw_gloo_seconds = min(yardsticks.raw_gloo_seconds, time.perf_counter() - started)
        progress.step("raw gloo broadcast")
    # The copy bandwidth: k processes copy at once; the span runs from the first start to the last end, so start
    # skew only makes the figure smaller (a conservative, i.e. generous, limit is never the result).
    copiers = min(cores(), 1 + case.receivers)
    pipes = workers.pipes[:copiers]
    workers.all_do([{"op": "copy_setup", "nbytes": COPY_BYTES}] * copiers, pipes)
    times = 2
    workers.all_do([{"op": "copy", "times": 1}] * copiers, pipes)  # warm-up
    for _ in range(COPY_TRIES):
        for method in ("tensor", "engine"):
            spans = workers.all_do([{"op": "copy", "times": times, "method": method}] * copiers, pipes)
            elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
            bandwidth = copiers * times * COPY_BYTES / elapsed
            if method == "tensor":
                yardsticks.copy_bandwidth = max(yardsticks.copy_bandwidth, bandwidth)
            else:
                yardsticks.engine_copy_bandwidth = max(yardsticks.engine_copy_bandwidth, bandwidth)
        progress.step(f"copy bandwidth, k={copiers}")
    yardsticks.copiers = copiers


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
