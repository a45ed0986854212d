"""One update as the manager sees it (a :class:`Round`): who takes part, what each worker reported, what failed, and
from that the outcome of every replica and the update's report; and the replica hooks and stage timing a round uses.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.api.errors import DigestMismatchError, LoadVerificationError
from weightsync.api.protocols import PausableReplica, RolloutReplica, RolloutWorker
from weightsync.api.types import (
    RankArgs,
    ReplicaOutcome,
    ReplicaState,
    TransferReport,
    UpdateReport,
    WorkerMetadata,
)
from weightsync.core.control import steps
from weightsync.core.control.host import is_untouched
from weightsync.core.wire.digest import combine_stripes

__all__ = ["Round", "disagreeing", "disowning", "host_of", "pause", "resume", "stage", "stripes_of", "worker_label"]


@dataclass
class Round:
    """What the manager knows about one update, filled in as it goes."""

    version: int
    replicas: list[RolloutReplica]
    workers: list[tuple[int, RolloutWorker]]
    """Every rollout worker, with the index of its replica."""
    stages: dict[str, float] = field(default_factory=dict)
    """Wall seconds per step (``UpdateReport.stages``)."""
    started: float = field(default_factory=time.perf_counter)
    rebuilt: bool = False
    transfer_started: bool = False
    reports: list[TransferReport | BaseException | None] = field(default_factory=list)
    """Each rollout worker's transfer result, in ``workers``' order (None: it never got one)."""
    senders: list[TransferReport] = field(default_factory=list)
    """The actor ranks' reports."""
    failure: BaseException | None = None
    disowned: set[int] = field(default_factory=set)
    """Replicas whose engine did not load what the transfer verified (the proof of load)."""
    swapped: set[int] | None = None
    """A staged update's: the replicas paused for their swap (bytes may have reached them); None for an unstaged
    update, in which every replica takes part once the transfer started."""
    resumed: dict[int, bool] = field(default_factory=dict)
    """A staged update's: per swapped replica, whether its swap resumed it."""
    stripes: dict[int, int] = field(default_factory=dict)
    """Actor rank → its stripe, when the topology dealt the update into stripes (``rank_args["stripe"]``)."""
    timing: dict[int, dict[str, float]] = field(default_factory=dict)
    """Per replica: seconds ``pause``d, to ``stage``, to ``swap`` (``ReplicaOutcome``'s ``*_seconds``)."""
    loads: dict[int, dict[str, str]] = field(default_factory=dict)
    """A staged update's: per swapped ``LoadProvingReplica``, the checksums it gave while paused for its swap."""

    @classmethod
    def of(cls, version: int, replicas: Sequence[RolloutReplica]) -> Round:
        workers = [(r, worker) for r, replica in enumerate(replicas) for worker in replica.workers]
        return cls(version, list(replicas), workers, reports=[None] * len(workers))

    def sent(self) -> dict[int, str]:
        """What each receiver must hold, by the sender its report names: that sender's digest; when the topology
        dealt the update into stripes (``stripes``), every receiver holds all of them, whose digests combine into
        one (``combine_stripes``, in stripe order), whichever stripe's sender it names."""
        digests = {report.rank: report.digest for report in self.senders if report.digest}
        if not self.stripes:
            return digests
        ranks = sorted(self.stripes, key=lambda rank: self.stripes[rank])
        if any(rank not in digests for rank in ranks):
            return {}  # a stripe's sender reported nothing: no receiver can be shown to hold the update
        combined = combine_stripes([digests[rank] for rank in ranks])
        return {rank: combined for rank in ranks}

    def check_digests(self) -> None:
        """``DigestMismatchError`` naming the first rollout worker whose digest is not what it was sent."""
        by_sender = self.sent()
        for (r, worker), report in zip(self.workers, self.reports):
            digest, sender = (report.digest, report.sender) if isinstance(report, TransferReport) else ("", -1)
            expected = by_sender.get(sender)
            if expected is None or digest != expected:
                raise DigestMismatchError(f"{worker_label(r, worker)} holds digest {digest[:16]} but actor rank "
                                          f"{sender} sent {str(expected)[:16]}", worker=worker_label(r, worker))

    def outcomes(self, previous: Sequence[ReplicaOutcome]) -> list[ReplicaOutcome]:
        """Every replica's outcome (``previous``: each replica's before this round), not yet resumed."""
        digests = self.sent()
        outcomes = []
        for r in range(len(self.replicas)):
            mine = [report for (owner, _), report in zip(self.workers, self.reports) if owner == r]
            verified = bool(mine) and all(
                isinstance(report, TransferReport) and report.digest == digests.get(report.sender) for report in mine
            )
            untouched = bool(mine) and all(
                isinstance(report, BaseException) and is_untouched(report) for report in mine
            )
            state: ReplicaState
            took_part = self.transfer_started and (self.swapped is None or r in self.swapped)
            if not took_part or untouched:
                state, held = previous[r].state, previous[r].version
            elif verified and r not in self.disowned:
                state, held = "committed", self.version
            else:
                state, held = "torn", None
            error = None
            if state == "torn" and self.failure is not None:
                error = f"{type(self.failure).__name__}: {self.failure}"
            changes = any(isinstance(report, TransferReport) and report.delta_buckets > 0 for report in mine)
            timing = self.timing.get(r, {})
            outcomes.append(ReplicaOutcome(
                replica=r, state=state, version=held, resumed=False, error=error,
                received="changes" if changes else "full", pause_seconds=timing.get("pause", 0.0),
                stage_seconds=timing.get("stage", 0.0), swap_seconds=timing.get("swap", 0.0)))
        return outcomes

    def report(self, outcomes: Sequence[ReplicaOutcome], *, backend: str, chosen: str, delta: bool) -> UpdateReport:
        """The update's report, once it completed (``delta``: ``SyncConfig.delta``)."""
        senders = self.senders
        total = sum(report.nbytes for report in senders)
        changed = sum(report.changed_bytes for report in senders)
        compared = delta and all(report.changed_bytes or report.base >= 0 for report in senders if report.nbytes)
        return UpdateReport(
            version=self.version, backend=backend, nbytes=total, seconds=time.perf_counter() - self.started,
            stages=self.stages, digest=next(iter(self.sent().values()), ""), receivers=len(self.workers),
            replicas=tuple(outcomes), transfers=tuple(
                [*senders, *(r for r in self.reports if isinstance(r, TransferReport))]
            ), rebuilt=self.rebuilt, chosen=chosen, wire_bytes=sum(report.wire_bytes for report in senders),
            changed_fraction=changed / total if compared and total else 1.0,
        )


def disagreeing(held: list[tuple[int, dict[str, str]]]) -> dict[int, str]:
    """Replica index → the first parameter where it differs from a strict majority of ``held`` (or where no strict
    majority exists: then every replica holding that parameter is listed)."""
    wrong: dict[int, str] = {}
    names = sorted(set().union(*(sums.keys() for _, sums in held)))
    for name in names:
        values = [(i, sums.get(name)) for i, sums in held]
        counts: dict[str | None, int] = {}
        for _, value in values:
            counts[value] = counts.get(value, 0) + 1
        best, count = max(counts.items(), key=lambda item: item[1])
        majority = best if count * 2 > len(values) else object()
        for i, value in values:
            if value != majority:
                wrong.setdefault(i, name)
    return wrong


def stripes_of(actor_args: Sequence[RankArgs]) -> dict[int, int]:
    """Actor rank → the stripe its ``rank_args`` deal it (``"stripe": [s, K]``); empty for an unstriped topology."""
    stripes: dict[int, int] = {}
    for rank, args in enumerate(actor_args):
        stripe = args.get("stripe")
        if isinstance(stripe, list) and stripe and isinstance(stripe[0], int):
            stripes[rank] = stripe[0]
    return stripes


def disowning(held: list[tuple[int, dict[str, str]]], disowned: set[int]) -> LoadVerificationError | None:
    """The proof of load over ``held`` (replica index, its checksums): the replicas that hold another value than
    the majority are added to ``disowned`` and the error names the first of them; None when all agree."""
    wrong = disagreeing(held)
    if not wrong:
        return None
    disowned.update(wrong)
    first = min(wrong)
    parameter = wrong[first]
    return LoadVerificationError(
        f"replica{first}'s engine holds another {parameter!r} than "
        f"{'the other replicas' if len(wrong) < len(held) else 'the replica(s) it was compared with'}"
        f" after the update (replicas disagreeing: {sorted(wrong)})", replica=f"replica{first}", parameter=parameter)


async def stage(stages: dict[str, float], step: str, timeout: float,
                 labelled: list[tuple[str, Awaitable[Any]]]) -> list[Any]:
    """``gather`` one step, recording its wall time in ``stages`` (also when it fails)."""
    started = time.perf_counter()
    try:
        return await steps.gather(step, timeout, labelled)
    finally:
        stages[step] = time.perf_counter() - started


async def pause(replica: RolloutReplica) -> None:
    if isinstance(replica, PausableReplica):  # both hooks in one round trip
        await replica.pause()
        return
    await replica.abort_all_requests()
    await replica.release_kv_cache()


async def resume(replica: RolloutReplica) -> None:
    if isinstance(replica, PausableReplica):
        await replica.resume()
        return
    await replica.resume_kv_cache()
    await replica.resume_generation()


def host_of(metadata: WorkerMetadata) -> str:
    """A worker's host for people: "name (address)" from its prepare() metadata, or whichever of them it gave."""
    name, address = metadata.get("hostname"), metadata.get("host_ip")
    if name and address:
        return f"{name} ({address})"
    return str(name or address or metadata.get("node_id") or "of unknown name")


def worker_label(replica: int, worker: RolloutWorker) -> str:
    try:
        name = worker.name
    except Exception:
        name = ""
    return f"replica{replica}/{name}" if name else f"replica{replica}"
