"""A staged update (``SyncConfig(staged=True)``) as the manager drives it: stage while serving, pause only to swap.

At setup the manager picks one rollout worker per host, its *stager* (:class:`StagedPlan`): only the stagers join
the transport's world, so the update crosses to each host once, into the host's staging area; every other worker
joins the epoch idle. An update dealt into K stripes (``stripes_for``: over K rails) has K stagers per host, the
host's first worker on each of those rails, each staging its stripe into an area of its own: the stripes' areas together are
the host's staging. Then, per update (:func:`run_staged`):

1. the actor ranks send and every stager stages (``StagingWorker.stage_weights``), the replicas serving;
2. each replica, as soon as every host it spans holds a verified staged copy, is paused, every worker of it applies
   from its host's staging area (``apply_staged``: the sink's usual path), the digests are compared with what was
   staged, a ``LoadProvingReplica`` gives its checksums (still paused: they are of what it applied), and it is
   resumed — replicas swap independently, each in a task of its own;
3. a replica one of whose hosts failed to stage is never paused: it keeps serving its old version (``untouched``).
   A swap that wrote some bytes and failed leaves its replica torn and paused, as an unstaged update does;
4. once every swap has ended, the checksums are compared (the proof of load, as after an unstaged transfer): a
   replica that holds another value than the majority is paused again and torn. Unlike an unstaged update, it
   has served between its own resume and the last swap; what it applied had passed the digest check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.api.config import StepTimeouts
from weightsync.api.errors import ConfigError, DigestMismatchError, TopologyError
from weightsync.api.protocols import ActorWorkerGroup, LoadProvingReplica, RolloutWorker, StagingWorker
from weightsync.api.types import StagedUpdate, TransferReport, WorldMetadata
from weightsync.core.control import steps
from weightsync.core.control.host import is_untouched
from weightsync.core.control.rails import rail_grace
from weightsync.core.control.round import Round, disowning, pause, resume, worker_label
from weightsync.core.transports.stripes import stripes_for
from weightsync.core.wire.digest import combine_stripes

__all__ = ["StagedPlan", "check_staging", "joined", "run_staged"]


@dataclass(frozen=True)
class StagedPlan:
    """Who stages for whom: each rollout worker's host, and each host's stagers (indices into the round's workers):
    the host's first worker in replica order, or with K stripes its first worker on each of the K rails (stripe
    s's stager at s)."""

    hosts: tuple[str, ...]
    stagers: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, world: WorldMetadata) -> StagedPlan:
        """From the workers' ``prepare`` metadata: where each rollout worker said it runs (``node_id``) and on which
        rail (``rail``), and how many stripes the topology will deal the update into (:func:`stripes_for`)."""
        metadata, used = world.rollout, stripes_for(world)
        hosts = tuple(str(entry.get("node_id") or f"unknown-{i}") for i, entry in enumerate(metadata))
        stagers: dict[str, tuple[int, ...]] = {}
        for host in dict.fromkeys(hosts):
            on_host = [i for i, where in enumerate(hosts) if where == host]
            rails = {i: metadata[i].get("rail", 0) for i in on_host}
            chosen = [next((i for i in on_host if len(used) == 1 or rails[i] == rail), None) for rail in used]
            if None in chosen:
                raise TopologyError(f"a staged update dealt over rails {used} needs a worker on each of them on host "
                                    f"{host}; its workers are on rails {sorted(set(map(str, rails.values())))}")
            stagers[host] = tuple(i for i in chosen if i is not None)
        return cls(hosts, stagers)

    @property
    def members(self) -> list[int]:
        """The workers that join the transport's world (every host's stagers), in the round's order."""
        return sorted(index for indices in self.stagers.values() for index in indices)


def check_staging(workers: Sequence[tuple[int, RolloutWorker]]) -> None:
    """``ConfigError`` naming the first rollout worker that cannot take part in a staged update."""
    for replica, worker in workers:
        if not isinstance(worker, StagingWorker):
            raise ConfigError(f"SyncConfig(staged=True): {worker_label(replica, worker)} is a "
                              f"{type(worker).__name__}, which cannot stage an update (it has no stage_weights / "
                              "apply_staged); use an unstaged update with it")


async def run_staged(round_: Round, *, actor_wg: ActorWorkerGroup, plan: StagedPlan, timeouts: StepTimeouts
                     ) -> list[BaseException]:
    """One staged update: send, stage, and every replica's swap; returns the errors, every task having ended."""
    version, workers = round_.version, round_.workers
    started = time.perf_counter()
    round_.transfer_started = True
    round_.swapped = set()
    sends = list(actor_wg.update_weights(version=version))
    timeout = timeouts.transfer + rail_grace(round_.stripes)
    sending = asyncio.ensure_future(steps.gather(
        "transfer", timeout, [(f"actor rank {rank}", call) for rank, call in enumerate(sends)],
        raise_first=False))
    staging: dict[str, asyncio.Future[StagedUpdate]] = {
        host: asyncio.ensure_future(_stage_host(round_, indices, timeout))
        for host, indices in plan.stagers.items()}
    swaps = [asyncio.ensure_future(_swap(round_, r, plan, staging, timeouts)) for r in range(len(round_.replicas))]
    results = await asyncio.gather(sending, *staging.values(), *swaps, return_exceptions=True)
    round_.stages["transfer"] = time.perf_counter() - started  # the stage and every swap, after any setup
    errors = [result for result in results if isinstance(result, BaseException)]
    wrong = await _prove_loads(round_, timeouts)
    if wrong is not None:
        errors.append(wrong)
    sent = results[0]
    if isinstance(sent, list):
        round_.senders = [outcome for outcome in sent if isinstance(outcome, TransferReport)]
        labels = [f"actor rank {rank}" for rank in range(len(sends))]
        errors += [steps.typed_error(outcome, step="transfer", worker=label) for outcome, label in zip(sent, labels)
                   if isinstance(outcome, BaseException)]
    return errors


async def _one(step: str, timeout: float, label: str, call: Awaitable[Any]) -> Any:
    return (await steps.gather(step, timeout, [(label, call)]))[0]


async def _stage_host(round_: Round, indices: Sequence[int], timeout: float) -> StagedUpdate:
    """One host's stage: its stager's update, or each stripe's from its stager (joined into one, ``stripes``)."""
    calls: list[Awaitable[Any]] = []
    for index in indices:
        replica, worker = round_.workers[index]
        calls.append(_one("stage", timeout, worker_label(replica, worker),
                          _staging(worker).stage_weights(version=round_.version)))
    parts = await asyncio.gather(*calls, return_exceptions=True)
    errors = [part for part in parts if isinstance(part, BaseException)]
    if errors:
        raise steps.root_cause(errors)
    staged = [part for part in parts if isinstance(part, StagedUpdate)]
    return staged[0] if len(staged) == 1 else joined(staged)


def joined(parts: Sequence[StagedUpdate]) -> StagedUpdate:
    """A host's stripes, each staged by a stager of its own (stripe order), as one ``StagedUpdate``: stripe 0's
    fields, ``stripes`` every part, and a report of the whole update (its digest ``combine_stripes``'s)."""
    done = [part.report for part in parts if part.report is not None]
    if len(done) != len(parts):
        raise ConfigError("a stripe's stager staged without a report: its stripe's digest cannot be combined")
    whole = dataclasses.replace(
        done[0], digest=combine_stripes([report.digest for report in done]), nbytes=sum(r.nbytes for r in done),
        tensors=sum(r.tensors for r in done), buckets=sum(r.buckets for r in done),
        wire_bytes=sum(r.wire_bytes for r in done), seconds=max(r.seconds for r in done))
    return dataclasses.replace(parts[0], report=whole, stripes=tuple(parts))


def _staging(worker: RolloutWorker) -> StagingWorker:
    if not isinstance(worker, StagingWorker):  # check_staging ran before the update started
        raise ConfigError(f"{type(worker).__name__} cannot stage an update")
    return worker


async def _swap(round_: Round, r: int, plan: StagedPlan, staging: dict[str, asyncio.Future[StagedUpdate]],
                timeouts: StepTimeouts) -> None:
    """Replica ``r``: wait for its hosts' staging; if all staged, pause, apply on every worker, check, resume (or
    leave it paused when torn). A failed staging leaves it serving; its error is the stager's, raised elsewhere."""
    mine = [(i, worker) for i, (owner, worker) in enumerate(round_.workers) if owner == r]
    hosts = {plan.hosts[i] for i, _ in mine}
    timing = round_.timing.setdefault(r, {})
    staged: dict[str, StagedUpdate] = {}
    try:
        for host in hosts:
            staged[host] = await asyncio.shield(staging[host])
    except Exception:  # noqa: BLE001 - the stager's error, raised by run_staged; a cancellation goes on
        return  # never paused: it serves its old version
    finally:
        timing["stage"] = time.perf_counter() - round_.started
    paused = time.perf_counter()
    failure: BaseException | None = None
    try:
        await _one("pause", timeouts.pause, f"replica{r}", pause(round_.replicas[r]))
        swapped = round_.swapped
        if swapped is not None:
            swapped.add(r)  # from here on, bytes may reach its model
        applied = time.perf_counter()
        results = await steps.gather("swap", timeouts.transfer, [
            (worker_label(r, worker), _staging(worker).apply_staged(version=round_.version,
                                                                     staged=staged[plan.hosts[i]]))
            for i, worker in mine], raise_first=False)
        timing["swap"] = time.perf_counter() - applied
        for (i, worker), result in zip(mine, results):
            round_.reports[i] = _checked(result, staged[plan.hosts[i]], worker_label(r, worker))
        errors = [steps.typed_error(report, step="swap", worker=f"replica{r}")
                  for report in (round_.reports[i] for i, _ in mine) if isinstance(report, BaseException)]
        replica = round_.replicas[r]
        if errors:
            failure = steps.root_cause(errors)
        elif isinstance(replica, LoadProvingReplica):
            sums = await _one("verify_load", timeouts.resume, f"replica{r}", replica.weight_checksums())
            round_.loads[r] = dict(sums)
    except BaseException as exc:  # the pause, the gather itself or the checksums
        failure = exc
    resume_failure = await _settle(round_, r, [i for i, _ in mine], timeouts, paused)
    failure = failure if failure is not None else resume_failure
    if failure is not None:
        raise failure


async def _prove_loads(round_: Round, timeouts: StepTimeouts) -> BaseException | None:
    """After every swap: the checksums the swapped replicas gave, compared; those that disagree with the majority
    are disowned and paused again (their outcome: torn). The ``LoadVerificationError``, or None."""
    error = disowning(sorted(round_.loads.items()), round_.disowned)
    if error is None:
        return None
    again = [r for r in sorted(round_.disowned) if round_.resumed.get(r)]
    results = await steps.gather("pause", timeouts.pause, [(f"replica{r}", pause(round_.replicas[r])) for r in again],
                                 raise_first=False)
    for r, result in zip(again, results):
        round_.resumed[r] = False
        if isinstance(result, BaseException):
            error.add_note(f"replica{r} could not be paused again: {type(result).__name__}: {result}")
    return error


def _checked(result: Any, staged: StagedUpdate, label: str) -> Any:
    """A worker's apply result, a ``DigestMismatchError`` when it applied other bytes than its host staged."""
    expected = staged.report.digest if staged.report is not None else ""
    if isinstance(result, TransferReport) and result.digest != expected:
        return DigestMismatchError(f"{label} applied digest {result.digest[:16]} from its host's staging area, which "
                                   f"was staged with {expected[:16]}", worker=label)
    return result


async def _settle(round_: Round, r: int, indices: list[int], timeouts: StepTimeouts, paused: float
                  ) -> BaseException | None:
    """After replica ``r``'s swap: resume it unless it is torn (a worker failed after bytes may have reached it);
    the resume's error, if it failed."""
    swapped = round_.swapped is not None and r in round_.swapped
    torn = swapped and any(not isinstance(report, TransferReport) and not (
        isinstance(report, BaseException) and is_untouched(report)) for report in (round_.reports[i] for i in indices))
    failure: BaseException | None = None
    if not torn:
        try:
            await _one("resume", timeouts.resume, f"replica{r}", resume(round_.replicas[r]))
        except BaseException as exc:  # it stays paused, and its outcome says so
            failure = exc
    round_.resumed[r] = not torn and failure is None
    round_.timing.setdefault(r, {})["pause"] = time.perf_counter() - paused
    return failure
