"""The staged flow (``SyncConfig(staged=True)``): stage while serving, pause each replica only for its swap.

At setup the manager picks one rollout worker per host, its *stager* (:class:`StagedPlan`): only the stagers join
the transport's world, so the update crosses to each host once, into the host's staging area; every other worker
joins the epoch idle. An update dealt into K stripes (``stripes_for``: over K rails) has K stagers per host, the
host's first worker on each of those rails, each staging its stripe into an area of its own: the stripes' areas together are
the host's staging. So has an update from the N sending ranks of a sharded ``actor_wg`` across hosts (``stream_rails``):
N stagers per host, each staging one rank's stream. Then, per update (:meth:`Staged.run`):

1. the actor ranks send and every stager stages (``StagingWorker.stage_weights``), the replicas serving;
2. each replica, as soon as every host it spans holds a verified staged copy, is paused, every worker of it applies
   from its host's staging area (``apply_staged``: the sink's usual path), the digests are compared with what was
   staged, a ``LoadProvingReplica`` gives its checksums (still paused: they are of what it applied), and it is
   resumed unless torn (the replica steps every flow shares) — replicas swap independently, each in a task of its
   own;
3. a replica one of whose hosts failed to stage is never paused: it keeps serving its old version (``untouched``).
   A swap that wrote some bytes and failed leaves its replica torn and paused, as an unstaged update does;
4. once every swap has ended and the senders have reported, each host's staged digest is compared with what was
   sent, and the checksums with each other (the proof of load, as after an unstaged transfer): a replica that
   staged other bytes than were sent or holds another value than the majority is disowned, paused again and torn.
   Unlike an unstaged update, it has served between its own resume and the last swap; what it applied had passed
   the digest check on its host.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.api.config import StepTimeouts
from weightsync.api.errors import ConfigError, DigestMismatchError, TopologyError
from weightsync.api.protocols import ActorWorkerGroup, LoadProvingReplica, RolloutWorker, StagingWorker
from weightsync.api.types import ReplicaOutcome, StagedUpdate, TransferReport, WorldMetadata
from weightsync.core.control import replicas, steps
from weightsync.core.control.rails import rail_grace
from weightsync.core.control.round import Round
from weightsync.core.control.setup import Epoch
from weightsync.core.transports.chain.groups import rail_groups
from weightsync.core.transports.chain.sources import stream_rails
from weightsync.core.transports.chain.stripes import stripes_for
from weightsync.core.transports.place import Place
from weightsync.core.transports.plan import decode_metadata
from weightsync.core.wire.digest import combine_stripes
from weightsync.core.wire.sources import combine_sources

__all__ = ["Staged", "StagedPlan", "joined"]


@dataclass(frozen=True)
class StagedPlan:
    """Who stages for whom: each rollout worker's host, and each host's stagers (indices into the round's workers):
    the host's first worker in replica order, or with K stripes its first worker on each of the K rails (stripe
    s's stager at s); where the hosts' part groups share the rails out (``rail_groups``), on its group's rails."""

    hosts: tuple[str, ...]
    stagers: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, world: WorldMetadata) -> StagedPlan:
        """From the workers' ``prepare`` metadata: where each rollout worker said it runs (``node_id``) and on which
        rail (``rail``), and how many stripes the topology will deal the update into (:func:`stripes_for`)."""
        places = [decode_metadata(entry, Place, who=f"rollout rank {i}") for i, entry in enumerate(world.rollout)]
        streams = stream_rails(world)
        used = streams if streams is not None else stripes_for(world)
        # Where the hosts' part groups share the rails out, a host's stagers are on its group's rails alone.
        grouped = {host: rails for _, members, rails in rail_groups(world) or () for host in members}
        hosts = tuple(place.node_id or f"unknown-{i}" for i, place in enumerate(places))
        stagers: dict[str, tuple[int, ...]] = {}
        for host in dict.fromkeys(hosts):
            on_host = [i for i, where in enumerate(hosts) if where == host]
            rails = {i: places[i].rail for i in on_host}
            chosen: list[int] = []
            for rail in grouped.get(host, used):
                left = [i for i in on_host if i not in chosen]
                pick = next((i for i in left if len(used) == 1 or rails[i] == rail),
                            left[0] if streams is not None and left else None)
                if pick is None:
                    raise TopologyError(
                        f"a staged update dealt over rails {used} needs a worker on each of them on host {host}; its "
                        f"workers are on rails {sorted(set(map(str, rails.values())))}" if streams is None else
                        f"a staged update from {len(used)} sending ranks of a sharded actor_wg needs a worker to "
                        f"stage each rank's stream on host {host}, which has {len(on_host)}")
                chosen.append(pick)
            stagers[host] = tuple(chosen)
        return cls(hosts, stagers)

    @property
    def members(self) -> list[int]:
        """The workers that join the transport's world (every host's stagers), in the round's order."""
        return sorted(index for indices in self.stagers.values() for index in indices)


@dataclass
class _Log:
    """What the staged flow records besides the round: each host's staging, and the checksums each swapped
    ``LoadProvingReplica`` gave while paused for its swap (they are of what it applied)."""

    plan: StagedPlan
    staging: dict[str, asyncio.Future[StagedUpdate]] = field(default_factory=dict)
    loads: dict[int, dict[str, str]] = field(default_factory=dict)


class Staged:
    """Stage on each host while serving; pause each replica only to swap its host's staged copy in."""

    def __init__(self, *, actor_wg: ActorWorkerGroup, timeouts: StepTimeouts) -> None:
        self.actor_wg = actor_wg
        self.timeouts = timeouts

    def check(self, workers: Sequence[tuple[int, RolloutWorker]]) -> None:
        """``ConfigError`` naming the first rollout worker that cannot take part in a staged update."""
        for replica, worker in workers:
            if not isinstance(worker, StagingWorker):
                raise ConfigError(f"SyncConfig(staged=True): {steps.worker_label(replica, worker)} is a "
                                  f"{type(worker).__name__}, which cannot stage an update (it has no stage_weights / "
                                  "apply_staged); use an unstaged update with it")

    def members(self, world: WorldMetadata) -> list[int]:
        """Only each host's stagers join the transport's world (one, or one per stripe); the host's other workers
        read their areas."""
        return StagedPlan.of(world).members

    async def run(self, round_: Round, epoch: Epoch, previous: Sequence[ReplicaOutcome]) -> None:
        """Send, stage, and every replica's swap; raises the root cause of what failed, every task having ended."""
        log = _Log(StagedPlan.of(epoch.world))
        started = time.perf_counter()
        timeout = self.timeouts.transfer + rail_grace(epoch.senders)
        sends = list(self.actor_wg.update_weights(version=round_.version))
        sending = asyncio.ensure_future(steps.gather(
            "transfer", timeout, [(steps.actor_label(rank), call) for rank, call in enumerate(sends)],
            raise_first=False))
        log.staging = {host: asyncio.ensure_future(self._stage_host(round_, indices, timeout))
                       for host, indices in log.plan.stagers.items()}
        swaps = [asyncio.ensure_future(self._swap(round_, r, log, previous)) for r in range(len(round_.replicas))]
        results = await asyncio.gather(sending, *log.staging.values(), *swaps, return_exceptions=True)
        round_.stages["transfer"] = time.perf_counter() - started  # the stage and every swap
        errors = [result for result in results if isinstance(result, BaseException)]
        sent = results[0]
        if isinstance(sent, list):
            round_.senders = [outcome for outcome in sent if isinstance(outcome, TransferReport)]
            errors += [steps.typed_error(outcome, step="transfer", worker=steps.actor_label(rank))
                       for rank, outcome in enumerate(sent) if isinstance(outcome, BaseException)]
        round_.stagers = {indices[0] for host, indices in log.plan.stagers.items()
                          if len(indices) == 1 and _succeeded(log.staging[host])}
        wrong = await self._disown(round_, log)
        if wrong is not None:
            errors.append(wrong)
        if errors:
            round_.failure = steps.root_cause(errors)
            raise round_.failure

    async def _stage_host(self, round_: Round, indices: Sequence[int], timeout: float) -> StagedUpdate:
        """One host's stage: its stager's update, or each stripe's from its stager (joined into one, ``stripes``)."""
        calls: list[Awaitable[Any]] = []
        for index in indices:
            replica, worker = round_.workers[index]
            calls.append(_one("stage", timeout, steps.worker_label(replica, worker),
                              _staging(worker).stage_weights(version=round_.version)))
        parts = await asyncio.gather(*calls, return_exceptions=True)
        errors = [part for part in parts if isinstance(part, BaseException)]
        if errors:
            raise steps.root_cause(errors)
        staged = [part for part in parts if isinstance(part, StagedUpdate)]
        return staged[0] if len(staged) == 1 else joined(staged)

    async def _swap(self, round_: Round, r: int, log: _Log, previous: Sequence[ReplicaOutcome]) -> None:
        """Replica ``r``: wait for its hosts' staging; if all staged, pause, apply on every worker, check, resume
        unless torn. A failed staging leaves it serving; its error is the stager's, raised by ``run``."""
        mine = round_.workers_of(r)
        hosts = {log.plan.hosts[i] for i in mine}
        staged: dict[str, StagedUpdate] = {}
        try:
            for host in hosts:
                staged[host] = await asyncio.shield(log.staging[host])
        except Exception:  # noqa: BLE001 - the stager's error, raised by run; a cancellation goes on
            return  # never paused: it serves its old version
        finally:
            round_.timing.setdefault(r, {})["stage"] = time.perf_counter() - round_.started
        failure: BaseException | None = None
        try:
            await replicas.pause(round_, [r], self.timeouts.pause)
            round_.reached.add(r)  # from here on, bytes may reach its model
            failure = await self._apply(round_, r, staged, log)
        except BaseException as exc:  # the pause, the gather itself or the checksums
            failure = exc
        resume_failure = await replicas.settle(round_, [r], previous, self.timeouts, cause=failure)
        failure = failure if failure is not None else resume_failure
        if failure is not None:
            raise failure

    async def _apply(self, round_: Round, r: int, staged: dict[str, StagedUpdate], log: _Log
                     ) -> BaseException | None:
        """Every worker of replica ``r`` applies its host's staged copy; each must hold what its host staged.
        The workers' failure, or None (then a ``LoadProvingReplica`` gives its checksums, still paused)."""
        mine = round_.workers_of(r)
        applied = time.perf_counter()
        results = await steps.gather("swap", self.timeouts.transfer, [
            (steps.worker_label(r, round_.workers[i][1]), _staging(round_.workers[i][1]).apply_staged(
                version=round_.version, staged=staged[log.plan.hosts[i]])) for i in mine], raise_first=False)
        round_.timing.setdefault(r, {})["swap"] = time.perf_counter() - applied
        for i, result in zip(mine, results):
            report = staged[log.plan.hosts[i]].report
            round_.expected[i] = report.digest if report is not None else ""
            round_.reports[i] = result
        errors = [steps.typed_error(result, step="swap", worker=f"replica{r}") for result in results
                  if isinstance(result, BaseException)]
        if errors:
            return steps.root_cause(errors)
        try:
            round_.check_digests(mine)
        except DigestMismatchError as exc:
            return exc
        replica = round_.replicas[r]
        if isinstance(replica, LoadProvingReplica):
            log.loads.update(await replicas.checksums(round_, [r], self.timeouts.resume))
        return None

    async def _disown(self, round_: Round, log: _Log) -> BaseException | None:
        """After every swap: a host whose staged digest is not what was sent, or a replica whose checksums disagree
        with the majority's, is disowned (torn) and paused again. The error, or None."""
        sent = set(round_.sent().values())
        error: BaseException | None = None
        for host, future in log.staging.items():
            staged = future.result() if _succeeded(future) else None
            digest = staged.report.digest if staged is not None and staged.report is not None else None
            if digest is None or not sent or digest in sent:
                continue
            error = error or DigestMismatchError(f"host {host} staged digest {digest[:16]}, which no sender sent",
                                                 worker=f"host {host}")
            round_.stagers.difference_update(log.plan.stagers[host])
            round_.disowned.update(r for r in round_.reached
                                   if any(log.plan.hosts[i] == host for i in round_.workers_of(r)))
        error = error or replicas.disowning(round_, log.loads)
        again = [r for r in sorted(round_.disowned) if round_.resumed.get(r)]
        if error is None or not again:
            return error
        results = await replicas.pause(round_, again, self.timeouts.pause, raise_first=False)
        for r, result in zip(again, results):
            if isinstance(result, BaseException):
                error.add_note(f"replica{r} could not be paused again: {type(result).__name__}: {result}")
        await replicas.tell_torn(round_, again, self.timeouts.resume)
        return error


def _succeeded(future: asyncio.Future[StagedUpdate]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


async def _one(step: str, timeout: float, label: str, call: Awaitable[Any]) -> Any:
    return (await steps.gather(step, timeout, [(label, call)]))[0]


def joined(parts: Sequence[StagedUpdate]) -> StagedUpdate:
    """A host's stripes (each staged by a stager of its own, stripe order), or a sharded ``actor_wg``'s streams (a
    stager each, ``sources`` one sender each: put in the senders' order), as one ``StagedUpdate``: the first part's
    fields, ``stripes`` every part (and ``sources`` every sender), and a report of the whole update (its digest
    ``combine_stripes``'s, or ``combine_sources``')."""
    streams = all(len(part.sources) == 1 for part in parts)
    if streams:
        parts = sorted(parts, key=lambda part: part.sources[0])
    done = [part.report for part in parts if part.report is not None]
    if len(done) != len(parts):
        raise ConfigError("a stripe's stager staged without a report: its stripe's digest cannot be combined")
    digests = [report.digest for report in done]
    whole = dataclasses.replace(
        done[0], digest=combine_sources(digests) if streams else combine_stripes(digests),
        nbytes=sum(r.nbytes for r in done), tensors=sum(r.tensors for r in done), buckets=sum(r.buckets for r in done),
        wire_bytes=sum(r.wire_bytes for r in done), seconds=max(r.seconds for r in done))
    senders = tuple(part.sources[0] for part in parts) if streams else ()
    return dataclasses.replace(parts[0], report=whole, stripes=tuple(parts), sources=senders)


def _staging(worker: RolloutWorker) -> StagingWorker:
    if not isinstance(worker, StagingWorker):  # Staged.check ran before the update started
        raise ConfigError(f"{type(worker).__name__} cannot stage an update")
    return worker
