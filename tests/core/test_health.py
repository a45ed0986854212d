"""The health check before an update (``weightsync.core.control.health``), over in-process workers: who counts as
dead (a ``WorkerDiedError``, no answer within the timeout) and who does not (an answer, or any other error)."""

from __future__ import annotations

import asyncio
from typing import Any

from weightsync.api.errors import StepTimeoutError, WorkerDiedError
from weightsync.core.control.health import dead_replicas, evicted_outcomes


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
