"""The update flows: how one update runs over an epoch that setup already built, from the replica steps
(:mod:`weightsync.core.control.replicas`) and the round's one rule for a replica's state.

- :class:`Unstaged` (the default): pause every replica; send and receive on every worker; check the digests and
  prove the load; finalize where needed; resume every replica that is not torn.
- :class:`~weightsync.core.control.staged.Staged` (``SyncConfig.staged``): stage on each host while serving, then
  pause each replica only for its swap.

A flow says at setup which rollout workers join the transport's world (``members``), checks before any work that
it can run over the workers it is given (``check``), and runs an update (``run``), settling every replica it paused
before it returns or raises.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from weightsync.api.config import StepTimeouts
from weightsync.api.errors import StepTimeoutError
from weightsync.api.protocols import ActorWorkerGroup, RolloutWorker
from weightsync.api.types import ReplicaOutcome, TransferReport, WorldMetadata
from weightsync.core.control import replicas, steps
from weightsync.core.control.rails import rail_grace
from weightsync.core.control.round import Round
from weightsync.core.control.setup import Epoch, Setup

__all__ = ["Flow", "Unstaged"]


class Flow(Protocol):
    def check(self, workers: Sequence[tuple[int, RolloutWorker]]) -> None:
        """A typed error naming the first worker this flow cannot run over, before any work starts."""

    def members(self, world: WorldMetadata) -> list[int]:
        """The rollout workers (indices) that join the transport's world; the others join the epoch idle."""

    async def run(self, round_: Round, epoch: Epoch, previous: Sequence[ReplicaOutcome]) -> None:
        """One update over ``epoch`` (``previous``: each replica's outcome before it)."""


class Unstaged:
    """Pause every replica, transfer into all of them at once, verify, resume."""

    def __init__(self, *, actor_wg: ActorWorkerGroup, timeouts: StepTimeouts, setup: Setup) -> None:
        self.actor_wg = actor_wg
        self.timeouts = timeouts
        self.setup = setup

    def check(self, workers: Sequence[tuple[int, RolloutWorker]]) -> None:
        return None  # every rollout worker takes an unstaged update

    def members(self, world: WorldMetadata) -> list[int]:
        return list(range(len(world.rollout)))

    async def run(self, round_: Round, epoch: Epoch, previous: Sequence[ReplicaOutcome]) -> None:
        everyone = range(len(round_.replicas))
        try:
            await replicas.pause(round_, everyone, self.timeouts.pause)
            await self._transfer(round_, epoch)
        except BaseException as exc:
            round_.failure = exc
            raise
        finally:
            resume_failure = await replicas.settle(round_, everyone, previous, self.timeouts)
        if resume_failure is not None:
            raise resume_failure

    async def _transfer(self, round_: Round, epoch: Epoch) -> None:
        """send/receive on every worker, the digests compared, the proof of load, and finalize where needed."""
        timeouts, workers, version = self.timeouts, round_.workers, round_.version
        round_.reached.update(range(len(round_.replicas)))
        started = time.perf_counter()
        sends = list(self.actor_wg.update_weights(version=version))
        labelled = [(steps.actor_label(rank), call) for rank, call in enumerate(sends)]
        labelled += [(steps.worker_label(r, worker), worker.update_weights(version=version)) for r, worker in workers]
        outcomes = await steps.gather("transfer", timeouts.transfer + rail_grace(epoch.senders), labelled,
                                      raise_first=False)
        round_.stages["transfer"] = time.perf_counter() - started
        round_.reports = outcomes[len(sends):]
        round_.senders = [outcome for outcome in outcomes[: len(sends)] if isinstance(outcome, TransferReport)]
        labels = [label for label, _ in labelled]
        failed = {id(outcome): (outcome, label) for outcome, label in zip(outcomes, labels)
                  if isinstance(outcome, BaseException)}  # one timeout error stands for every pending worker
        timed_out = steps.timeout_of(labels, outcomes)
        errors = [outcome if outcome is timed_out else steps.typed_error(outcome, step="transfer", worker=label)
                  for outcome, label in failed.values()]
        if errors:
            raise await self._explain(errors, timed_out, workers, epoch)
        round_.check_digests()
        held = await replicas.checksums(round_, range(len(round_.replicas)), timeouts.resume, at_least=2)
        wrong = replicas.disowning(round_, held)
        if wrong is not None:
            raise wrong
        if not all(isinstance(report, TransferReport) and report.finalized for report in outcomes):
            # A host that does not finalize within its transfer call (ours do: one round trip fewer).
            await steps.timed(round_.stages, "finalize", timeouts.finalize, [
                *steps.actor_calls("finalize", actor_wg=self.actor_wg), *steps.worker_calls(workers, "finalize")])

    async def _explain(self, errors: list[BaseException], timed_out: StepTimeoutError | None,
                       workers: Sequence[tuple[int, RolloutWorker]], epoch: Epoch) -> BaseException:
        """The error a failed transfer raises. When it timed out, every worker is pinged: a host none of whose
        workers answers cannot be reached (``HostUnreachableError`` naming it), and that explains the rest."""
        if timed_out is not None:
            down = await steps.unreachable(timed_out, self.timeouts.transfer, self.setup.pings(workers), epoch.where)
            if down is not None:
                for error in errors:
                    if error is not timed_out:
                        down.add_note(f"also: {type(error).__name__}: {error}")
                return down
        return steps.root_cause(errors)
