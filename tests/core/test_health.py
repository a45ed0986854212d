"""The health check before an update (``weightsync.core.control.health``), over in-process workers: who counts as
dead (a ``WorkerDiedError``, no answer within the timeout) and who does not (an answer, or any other error); and
the second transfer of an update that lost a replica (``weightsync.core.control.eviction``), over a round's record."""

from __future__ import annotations

import asyncio
from typing import Any

from weightsync.api.errors import StepTimeoutError, WorkerDiedError
from weightsync.api.types import ReplicaOutcome, TransferReport
from weightsync.core.control.eviction import retry_of
from weightsync.core.control.health import dead_replicas, evicted_outcomes
from weightsync.core.control.round import Round


class Worker:
    def __init__(self, name: str, answer: str) -> None:
        self.name, self._answer = name, answer

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return self._ping()

    async def _ping(self) -> dict[str, str]:
        if self._answer == "died":
            raise WorkerDiedError("Ray declared the actor dead", worker=self.name, step="")
        if self._answer == "silent":
            await asyncio.sleep(30)
        if self._answer == "failed":
            raise RuntimeError("no ping here")
        return {"node_id": "a"}


def test_a_dead_or_silent_worker_makes_its_replica_dead_and_nothing_else_does() -> None:
    workers: list[tuple[int, Any]] = [
        (0, Worker("w0", "ok")), (0, Worker("w1", "failed")),  # an error that is not a death: alive
        (1, Worker("w0", "ok")), (1, Worker("w1", "died")),
        (2, Worker("w0", "silent")),
    ]
    dead = asyncio.run(dead_replicas(workers, 0.2))
    assert sorted(dead) == [1, 2]
    assert isinstance(dead[1], WorkerDiedError) and str(dead[1]).startswith("replica1/w1 died during health")
    assert isinstance(dead[2], StepTimeoutError) and "replica2/w0 did not answer a ping within 0.2s" in str(dead[2])
    outcomes = evicted_outcomes(dead)
    assert [(outcome.replica, outcome.state, outcome.version) for outcome in outcomes] == [
        (1, "evicted", None), (2, "evicted", None)]
    assert outcomes[0].error is not None and outcomes[0].error.startswith("WorkerDiedError: replica1/w1")


def test_workers_that_cannot_be_called_are_not_judged() -> None:
    class Uncallable:
        name = "w0"

        def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
            raise AttributeError("no engine")

    uncallable: Any = Uncallable()
    assert asyncio.run(dead_replicas([(0, uncallable)], 0.2)) == {}


def test_a_retry_covers_the_survivors_that_lack_the_version_and_its_outcomes_replace_theirs() -> None:
    """``eviction.retry_of`` over a failed round of four one-worker replicas: 0 committed, 1 died (lost), 2 torn
    (paused, not resumed), 3 never reached (it served on). The retry takes 2 (not paused again: held) and 3; the
    update's outcomes are 0's own and the retry's, replica 1 left out and the others renumbered."""
    replicas: list[Any] = [Replica() for _ in range(4)]
    first = Round.of(5, replicas)
    first.senders = [report("actor", 0, "d5")]
    first.reached = {0, 1, 2}
    first.reports = [report("rollout", 0, "d5"), RuntimeError("died"), report("rollout", 2, "partial"), None]
    first.paused_at, first.resumed = {0: 1.0, 1: 1.0, 2: 1.0}, {0: True, 1: False, 2: False}
    before = [ReplicaOutcome(replica=r, state="committed", version=4, resumed=True) for r in range(4)]
    made = retry_of(first, {1: WorkerDiedError("gone", worker="replica1", step="transfer")}, before)
    assert made is not None
    retry, previous = made
    assert first.retried == [2, 3] and retry.replicas == [replicas[2], replicas[3]]
    assert retry.held == {0} and retry.paused_at == {0: 1.0}
    assert [(outcome.state, outcome.version) for outcome in previous] == [("torn", None), ("committed", 4)]
    retry.senders, retry.reached = [report("actor", 0, "d5")], {0, 1}
    retry.reports, retry.resumed = [report("rollout", 0, "d5"), report("rollout", 1, "d5")], {0: True, 1: True}
    outcomes = first.outcomes(before)
    assert [(outcome.replica, outcome.state, outcome.version) for outcome in outcomes] == [
        (0, "committed", 5), (1, "committed", 5), (2, "committed", 5)]
    assert [(outcome.replica, outcome.state) for outcome in first.evicted] == [(1, "evicted")]
    # Negative control: without the retry, replica 2 (now 1) stays torn and 3 (now 2) holds its old version.
    first.retry = None
    assert [(outcome.state, outcome.version) for outcome in first.outcomes(before)] == [
        ("committed", 5), ("torn", None), ("committed", 4)]


class Replica:
    workers = [object()]


def report(role: Any, rank: int, digest: str) -> TransferReport:
    return TransferReport(role=role, rank=rank, version=5, nbytes=10, tensors=1, buckets=1, seconds=0.1, digest=digest)


def test_catch_up_says_why_it_cannot_run_and_what_a_peer_is_checked_against() -> None:
    import dataclasses

    from weightsync.api.config import SyncConfig
    from weightsync.api.types import UpdateReport
    from weightsync.core.control.join import fingerprint, why_not

    for config in (SyncConfig(delta=True), SyncConfig(staged=True), SyncConfig(delta=True, staged=True)):
        assert why_not(config, version=3, model="m") == ""
    assert "delta=True) or staged=True" in why_not(SyncConfig(), version=3, model="m")
    assert "no digest of the last version" in why_not(SyncConfig(delta=True), version=3, model="")
    sender = dataclasses.replace(report("actor", 0, "stream"), model="model")
    drained = dataclasses.replace(report("actor", 1, ""), nbytes=0)  # a rank that drained its stream
    update = UpdateReport(version=5, backend="shm", nbytes=10, seconds=0.1,
                          transfers=(sender, drained, report("rollout", 0, "stream")))
    assert fingerprint(SyncConfig(delta=True), update, striped=False) == "model"
    assert fingerprint(SyncConfig(delta=True, staged=True), update, striped=False) == "model"
    assert fingerprint(SyncConfig(staged=True), update, striped=False) == "stream"
    assert fingerprint(SyncConfig(staged=True), update, striped=True) == ""  # a stripe per area: no whole copy
    assert fingerprint(SyncConfig(), update, striped=False) == ""
    two = dataclasses.replace(update, transfers=(sender, dataclasses.replace(report("actor", 1, "other"),
                                                                             model="other")))
    assert fingerprint(SyncConfig(staged=True), two, striped=False) == ""  # several sending streams
    assert fingerprint(SyncConfig(delta=True), two, striped=False) == ""
