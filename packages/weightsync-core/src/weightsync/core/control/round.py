"""One update as the manager sees it (a :class:`Round`): who takes part, what each worker reported, what failed,
and from that — by one rule for every flow — the state of every replica and the update's report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from weightsync.api.errors import DigestMismatchError
from weightsync.api.protocols import RolloutReplica, RolloutWorker
from weightsync.api.types import ReplicaOutcome, ReplicaState, TransferReport, UpdateReport
from weightsync.core.control.steps import worker_label
from weightsync.core.wire.digest import combine_stripes
from weightsync.core.wire.sources import combine_sources
from weightsync.core.worker.host import is_untouched

__all__ = ["Round"]


@dataclass
class Round:
    """What the manager knows about one update, filled in as it goes, whichever flow runs it."""

    version: int
    replicas: list[RolloutReplica]
    workers: list[tuple[int, RolloutWorker]]
    """Every rollout worker, with the index of its replica."""
    stages: dict[str, float] = field(default_factory=dict)
    """Wall seconds per step (``UpdateReport.stages``)."""
    started: float = field(default_factory=time.perf_counter)
    rebuilt: bool = False
    stripes: tuple[tuple[int, ...], ...] = ()
    """Each group's stripe senders in stripe order, when the epoch's topology dealt the update into stripes."""
    sources: tuple[int, ...] = ()
    """The senders of a sharded ``actor_wg``, in the order their digests combine."""
    reports: list[TransferReport | BaseException | None] = field(default_factory=list)
    """Each rollout worker's transfer result, in ``workers``' order (None: it never got one)."""
    expected: dict[int, str] = field(default_factory=dict)
    """Worker index → the digest it must hold, where that is not its sender's (a swap: what its host staged)."""
    senders: list[TransferReport] = field(default_factory=list)
    """The actor ranks' reports."""
    failure: BaseException | None = None
    reached: set[int] = field(default_factory=set)
    """Replicas bytes of this update may have reached (their models may no longer hold their old version)."""
    disowned: set[int] = field(default_factory=set)
    """Replicas whose engine did not load what the transfer verified (the proof of load), or whose host staged
    other bytes than were sent."""
    paused_at: dict[int, float] = field(default_factory=dict)
    """Replica → when its pause began."""
    resumed: dict[int, bool] = field(default_factory=dict)
    """Replica → whether this update resumed it (absent: this update never paused it)."""
    timing: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per replica: seconds ``pause``d, and what a flow measured besides (``ReplicaOutcome``'s ``*_seconds``)."""
    evicted: list[ReplicaOutcome] = field(default_factory=list)
    """Replicas this update evicted (``weightsync.core.control.health``, ``weightsync.core.control.eviction``)."""
    joined: list[ReplicaOutcome] = field(default_factory=list)
    """Replicas added since the last update, as their catch-up from a peer left them
    (``weightsync.core.control.join``)."""
    lost: set[int] = field(default_factory=set)
    """Replicas that died during this round, evicted: left out of its outcomes."""
    retry: Round | None = None
    """The second transfer of this update, over the survivors that lack the version (``retried``)."""
    retried: list[int] = field(default_factory=list)
    """This round's index of each of ``retry``'s replicas."""
    held: set[int] = field(default_factory=set)
    """Replicas an earlier round of this update paused and left paused: pausing them again is skipped."""
    stagers: set[int] = field(default_factory=set)
    """Workers (indices into ``workers``) that staged this version alone on their host, sealed (a staged update):
    each can serve it to a replica that joins (``weightsync.core.control.join``)."""

    @classmethod
    def of(cls, version: int, replicas: Sequence[RolloutReplica]) -> Round:
        workers = [(r, worker) for r, replica in enumerate(replicas) for worker in replica.workers]
        return cls(version, list(replicas), workers, reports=[None] * len(workers))

    def workers_of(self, replica: int) -> list[int]:
        """Indices (into ``workers``) of ``replica``'s workers."""
        return [i for i, (owner, _) in enumerate(self.workers) if owner == replica]

    def sent(self) -> dict[int, str]:
        """What each receiver must hold, by the sender its report names: that sender's digest; when the topology
        dealt the update into stripes (``stripes``), every receiver holds all of its group's (one group, or a group
        per part of the model), whose digests combine into one (``combine_stripes``, in stripe order), whichever of
        them its report names; from a sharded ``actor_wg`` (``sources``), the senders' digests combined
        (``combine_sources``, in their order)."""
        digests = {report.rank: report.digest for report in self.senders if report.digest}
        if self.sources:  # every receiver reads every sender's stream
            if any(rank not in digests for rank in self.sources):
                return {}
            combined = combine_sources([digests[rank] for rank in self.sources])
            return {rank: combined for rank in self.sources}
        if not self.stripes:
            return digests
        sent: dict[int, str] = {}
        for ranks in self.stripes:  # a group of stripes each (its own part of the model), or one
            if all(rank in digests for rank in ranks):  # else a stripe's sender reported nothing: not its group
                sent.update(dict.fromkeys(ranks, combine_stripes([digests[rank] for rank in ranks])))
        return sent

    def _expected(self, index: int, report: TransferReport, sent: dict[int, str]) -> str | None:
        return self.expected.get(index, sent.get(report.sender))

    def check_digests(self, indices: Sequence[int] | None = None) -> None:
        """``DigestMismatchError`` naming the first rollout worker (of ``indices``; default every one) whose digest
        is not what it was sent (or, in a swap, what its host staged)."""
        sent = self.sent()
        for index in range(len(self.workers)) if indices is None else indices:
            (r, worker), report = self.workers[index], self.reports[index]
            digest, sender = (report.digest, report.sender) if isinstance(report, TransferReport) else ("", -1)
            expected = self._expected(index, report, sent) if isinstance(report, TransferReport) else None
            if expected is None or digest != expected:
                raise DigestMismatchError(f"{worker_label(r, worker)} holds digest {digest[:16]} but actor rank "
                                          f"{sender} sent {str(expected)[:16]}", worker=worker_label(r, worker))

    def state_of(self, replica: int, previous: ReplicaOutcome) -> tuple[ReplicaState, int | None]:
        """The rule every flow shares: a replica the update never reached, or whose every worker failed before a
        byte reached its model (untouched), holds what it held; one whose every worker holds a verified digest and
        that was not disowned holds the new version (committed); any other is torn."""
        mine = [(i, self.reports[i]) for i in self.workers_of(replica)]
        untouched = bool(mine) and all(isinstance(report, BaseException) and is_untouched(report)
                                       for _, report in mine)
        if replica not in self.reached or untouched:
            return previous.state, previous.version
        sent = self.sent()
        verified = bool(mine) and all(isinstance(report, TransferReport)
                                      and report.digest == self._expected(i, report, sent) for i, report in mine)
        if verified and replica not in self.disowned:
            return "committed", self.version
        return "torn", None

    def outcomes(self, previous: Sequence[ReplicaOutcome]) -> list[ReplicaOutcome]:
        """Every replica's outcome (``previous``: each replica's before this round), the retried ones' from their
        retry, the lost ones left out (the others renumbered in order)."""
        outcomes = self.own_outcomes(previous)
        if self.retry is not None:
            for r, outcome in zip(self.retried, self.retry.outcomes([outcomes[r] for r in self.retried])):
                outcomes[r] = outcome
        kept = [outcome for r, outcome in enumerate(outcomes) if r not in self.lost]
        return [dataclasses.replace(outcome, replica=i) for i, outcome in enumerate(kept)]

    def own_outcomes(self, previous: Sequence[ReplicaOutcome]) -> list[ReplicaOutcome]:
        """Every replica's outcome from this round alone (no retry; the lost ones included)."""
        now = time.perf_counter()
        outcomes = []
        for r in range(len(self.replicas)):
            state, held = self.state_of(r, previous[r])
            error = None
            if state == "torn" and self.failure is not None:
                error = f"{type(self.failure).__name__}: {self.failure}"
            mine = [self.reports[i] for i in self.workers_of(r)]
            changes = any(isinstance(report, TransferReport) and report.delta_buckets > 0 for report in mine)
            timing = self.timing.get(r, {})
            paused = timing.get("pause", now - self.paused_at[r] if r in self.paused_at else 0.0)
            outcomes.append(ReplicaOutcome(
                replica=r, state=state, version=held, resumed=self.resumed.get(r, previous[r].resumed), error=error,
                received="changes" if changes else "full", pause_seconds=paused,
                stage_seconds=timing.get("stage", 0.0), swap_seconds=timing.get("swap", 0.0)))
        return outcomes

    def report(self, outcomes: Sequence[ReplicaOutcome], *, backend: str, chosen: str, delta: bool) -> UpdateReport:
        """The update's report, once it completed (``delta``: ``SyncConfig.delta``). After a retry: the model's size
        and digest from whichever transfer's senders reported, the retry's stages as ``retry_<stage>``, the bytes on
        the wire and the transfers of both."""
        rounds = [self] if self.retry is None else [self, self.retry]
        senders = self.senders or (self.retry.senders if self.retry is not None else [])
        total = sum(report.nbytes for report in senders)
        changed = sum(report.changed_bytes for report in senders)
        compared = delta and all(report.changed_bytes or report.base >= 0 for report in senders if report.nbytes)
        stages = dict(self.stages)
        if self.retry is not None:
            stages.update({f"retry_{stage}": seconds for stage, seconds in self.retry.stages.items()})
        lost = sum(1 for owner, _ in self.workers if owner in self.lost)
        digests = [digest for r in rounds for digest in r.sent().values()]
        return UpdateReport(
            version=self.version, backend=backend, nbytes=total, seconds=time.perf_counter() - self.started,
            stages=stages, digest=digests[0] if digests else "",
            receivers=len(self.workers) - lost, replicas=tuple(outcomes), evicted=tuple(self.evicted),
            joined=tuple(self.joined),
            transfers=tuple(report for r in rounds for report in [
                *r.senders, *(report for report in r.reports if isinstance(report, TransferReport))]),
            rebuilt=self.rebuilt, chosen=chosen, changed_fraction=changed / total if compared and total else 1.0,
            wire_bytes=sum(report.wire_bytes for r in rounds for report in r.senders),
        )
