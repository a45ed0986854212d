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
from weightsync.api.registry import load_engine_class
from weightsync.api.topology import epoch_of, with_epoch
from weightsync.api.types import RankArgs, StagedUpdate, WorldMetadata
from weightsync.cli.bench.scenario import BASELINES, Case
from weightsync.cli.bench.worker import Channel, c10d, serve
from weightsync.cli.progress import Progress
from weightsync.core.control.auto import AUTO, choose
from weightsync.core.transports.place import default_node_id, has_rdma
from weightsync.core.transports.plan import Idle, encode_plan
from weightsync.core.control.staged import StagedPlan, joined

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
    serving: ServingFigures | None = None
    """``--staged``: what the receivers' serving loops saw."""


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
    """Every worker a ``multiprocessing`` child of the driver on this machine, over a ``Pipe``."""

    testbed = False
    rails = 1

    def start(self, spec: dict[str, Any], *, host: int) -> Spawned:
        context = multiprocessing.get_context("spawn")
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
            options: dict[str, Any] = {"delta": True, "verify_every": case.verify_every} if case.delta else {}
            if case.staged:  # advertised in the metadata: a striped topology gives each stager its stripe
                options["staged"] = True
            common.update(kind="engine", backend=case.backend, options=options)
        self.backend, self.chosen = case.backend, ""
        if case.backend == AUTO:
            # What the manager's auto would pick for these workers: their hosts are the testbed's (or this one), whose
            # NICs are this machine's.
            rails = placement.rails
            choice = choose(sender_node=str(case.host_of(0)),
                            rollout_nodes=[str(case.host_of(rank)) for rank in case.receiving],
                            rdma=has_rdma(), sender_rails=[case.local_rank(rank) % rails for rank in range(case.actors)],
                            rollout_rails=[case.local_rank(rank) % rails for rank in case.receiving])
            self.backend, self.chosen = choice.backend, choice.name
            common.update(backend=choice.backend, options={**choice.options, **common["options"]})
        self.pipes: list[Channel] = []
        self.stops: list[Callable[[float], None]] = []
        self.actors = case.actors
        self.plan: StagedPlan | None = None
        """A staged entry's stagers, picked at ``connect``."""
        for group_rank in range(case.actors + case.receivers):
            role, rank = ("actor", group_rank) if group_rank < case.actors else ("rollout", group_rank - case.actors)
            spec = {**common, "role": role, "rank": rank, "group_rank": group_rank,
                    "local_rank": case.local_rank(group_rank)}
            spawned = placement.start(spec, host=case.host_of(group_rank))
            self.pipes.append(spawned.channel)
            self.stops.append(spawned.stop)

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

    def connect(self, receivers: int, *, staged: bool = False) -> None:
        """Join the workers; ``staged``: only each host's stagers (``StagedPlan``'s, as the manager picks them) join
        the transport's world as receivers, the other receivers the epoch, idle."""
        if self.name in BASELINES:
            if self.placement.testbed:
                # On a testbed the driver is unreachable: group rank 0 hosts the store on its host's address.
                store = self.all_do([{"op": "store"}], self.pipes[:1])[0]
                self.each("init", **store)
            else:
                self.each("init")
            return
        metadata = self.each("prepare")
        actors = list(range(self.actors))
        members = list(range(self.actors, self.actors + receivers))
        if staged:
            self.plan = StagedPlan.of(WorldMetadata(actor=metadata[:self.actors], rollout=metadata[self.actors:]))
            members = [self.actors + index for index in self.plan.members]
        topology = with_epoch(load_engine_class(self.backend).build_topology(
            actor_wg_world_size=self.actors, rollout_world_size=len(members),
            metadata=WorldMetadata(actor=metadata[:self.actors], rollout=[metadata[rank] for rank in members]),
        ))
        idle = encode_plan(Idle(epoch=epoch_of(topology.actor[0])))
        rank_args: list[RankArgs] = [idle] * (self.actors + receivers)
        for rank, args in zip([*actors, *members], [*topology.actor, *topology.rollout]):
            rank_args[rank] = args
        self.all_do([{"op": "init", "rank_args": args} for args in rank_args])

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
    this machine); where it has links, their counters are read before and after every timed update (untimed)."""
    placement = placement or LocalPlacement()
    workers = _Workers(case, placement)
    links = _LinkBytes()
    serving: ServingFigures | None = None
    try:
        workers.connect(case.receivers, staged=case.staged)
        if case.serving:
            serving = _start_serving(workers)
        workers.each("mark")
        workers.each("load", version=0)
        _update(workers, case, None)
        progress.step(f"{case.name}: warm-up")
        seconds = []
        for index in range(case.repeat):
            workers.each("load", version=index + 1)
            before = placement.read_links()
            seconds.append(_update(workers, case, serving))
            after = placement.read_links()
            if before is not None and after is not None:
                links.add(before, after)
            progress.step(f"{case.name}: update {index + 1}/{case.repeat}")
        # Taken before any yardstick allocates: the peak over the updates only.
        peak_extra = max(workers.each("rss")) / MiB
        if serving is not None:
            serving.failed_requests = sum(workers.each_receiver("failed"))
        if trace is not None:
            _trace_update(workers, case, progress, trace)
        if yardsticks is not None:
            _measure_yardsticks(workers, case, progress, yardsticks)
    finally:
        workers.close()
    rates = sorted(case.total_bytes / s / 1e9 for s in seconds)
    p90 = rates[max(0, round(0.1 * (len(rates) - 1)))]  # 90% of the updates were at least this fast
    return BenchResult(backend=case.name, gbps_p50=statistics.median(rates), gbps_p90=p90,
                       peak_extra_rss_mb=peak_extra, seconds=seconds, sender_egress_bytes=links.egress,
                       host_ingress_bytes=links.ingress, rail_egress_bytes=links.rail_egress,
                       rail_ingress_bytes=links.rail_ingress, chosen=workers.chosen, serving=serving)


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


def _update(workers: _Workers, case: Case, serving: ServingFigures | None) -> float:
    """One update; its seconds (a staged one's from the start of the stage to the last resume). With
    ``case.serving`` every receiver serves outside its pause, and the pause figures go to ``serving``."""
    if case.staged:
        return _staged_update(workers, case, serving)
    lasts = workers.each_receiver("pause") if case.serving else []
    started = time.perf_counter()
    workers.each("run")
    seconds = time.perf_counter() - started
    if case.serving:
        _record_pauses(workers, serving, lasts, workers.each_receiver("resume"))
    return seconds


def _staged_update(workers: _Workers, case: Case, serving: ServingFigures | None) -> float:
    """Stage on each host's stagers (one, or one per stripe) while every receiver serves, then every receiver swaps
    from its host's areas."""
    plan, receivers = workers.plan, case.receiving
    if plan is None:
        raise RuntimeError(f"{case.name}: a staged update before the stagers were picked")
    stagers = {case.actors + index for index in plan.members}
    started, stage_start = time.perf_counter(), time.monotonic()
    replies = workers.all_do([*[{"op": "run"}] * case.actors,
                              *({"op": "stage", "version": 0} if rank in stagers else {"op": "noop"}
                                for rank in receivers)])
    stage_end = time.monotonic()
    staged = {host: joined([StagedUpdate.from_dict(replies[case.actors + index]) for index in indices]).to_dict()
              if len(indices) > 1 else replies[case.actors + indices[0]] for host, indices in plan.stagers.items()}
    swaps = workers.all_do([{"op": "swap", "staged": staged[plan.hosts[rank - case.actors]]} for rank in receivers],
                           workers.pipes[case.actors:])
    seconds = time.perf_counter() - started
    if serving is not None:
        counts = workers.each_receiver("count", start=stage_start, end=stage_end)
        serving.served_during_stage.append(int(statistics.median(counts)))
        serving.stage_seconds.append(stage_end - stage_start)
        serving.apply_ms.append(max(swap["apply_seconds"] for swap in swaps) * 1e3)
        _record_pauses(workers, serving, [swap["last_before"] for swap in swaps], [swap["mark"] for swap in swaps])
    return seconds


def _record_pauses(workers: _Workers, serving: ServingFigures | None, lasts: list[float], marks: list[int]) -> None:
    """The longest pause of any receiver: its last pass before the pause to its first after the resume."""
    if serving is None:
        return
    firsts = workers.all_do([{"op": "first_after", "mark": mark} for mark in marks], workers.pipes[workers.actors:])
    serving.pause_ms.append(max(first - last for first, last in zip(firsts, lasts)) * 1e3)


def _trace_update(workers: _Workers, case: Case, progress: Progress, trace: list[dict[str, Any]]) -> None:
    workers.each("load", version=case.repeat + 1)
    started = time.perf_counter()
    for events in workers.each("trace"):
        trace.extend(events)
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
