"""Health between updates: before an update the manager pings every rollout worker, and a replica with a dead worker
is evicted — left out of the update and of the membership — so that one death does not stop every other replica's
update (``SyncConfig.max_evicted``).

Dead means: the worker's ping raised ``WorkerDiedError`` (an adapter's word that the process is gone: the Ray
adapter says so when Ray declares the actor dead), or it did not answer within the setup timeout (a process stopped,
a host or link gone silent). Any other answer, an error included (an adapter without ``ping``), is a live worker: a
failure that is not a death is the update's to report, not a reason to drop a replica. Nothing is paused or changed
here; the replicas keep serving while they are pinged.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.errors import StepTimeoutError, WorkerDiedError
from weightsync.api.protocols import RolloutWorker
from weightsync.api.types import ReplicaOutcome
from weightsync.core.control import steps

__all__ = ["dead_replicas", "dead_workers", "evicted_outcomes", "replicas_of"]


async def dead_replicas(workers: Sequence[tuple[int, RolloutWorker]], timeout: float) -> dict[int, BaseException]:
    """Replica index → why it is dead (the first of its workers found so), from one ping to every worker (module
    docstring); {} where the workers cannot even be called."""
    try:
        pings = steps.worker_calls(workers, "ping")
    except Exception:  # noqa: BLE001 - an adapter without ping: no health check, the update's own errors stand
        return {}
    return replicas_of(workers, pings, await dead_workers(pings, timeout))


async def dead_workers(pings: steps.Labelled, timeout: float, *, during: str = "health") -> dict[str, BaseException]:
    """Label → why, for each worker of ``pings`` (labelled ``ping`` calls) found dead (module docstring; ``during``:
    the step its error names)."""
    answers = await steps.gather("health", timeout, pings, raise_first=False)
    dead: dict[str, BaseException] = {}
    for (label, _), answer in zip(pings, answers):
        if not isinstance(answer, BaseException):
            continue
        if isinstance(answer, StepTimeoutError) and answer.step == "health":
            dead[label] = StepTimeoutError(f"{label} did not answer a ping within {timeout:g}s", step="health",
                                           workers=[label])
            continue
        error = steps.typed_error(answer, step=during, worker=label)
        if isinstance(error, WorkerDiedError):
            dead[label] = error
    return dead


def replicas_of(workers: Sequence[tuple[int, RolloutWorker]], pings: steps.Labelled,
                dead: dict[str, BaseException]) -> dict[int, BaseException]:
    """Replica index → why it is dead (its first dead worker's reason), from ``dead_workers``' answer to ``pings``
    (one per worker of ``workers``, in their order)."""
    replicas: dict[int, BaseException] = {}
    for (replica, _), (label, _) in zip(workers, pings):
        if label in dead:
            replicas.setdefault(replica, dead[label])
    return replicas


def evicted_outcomes(dead: dict[int, BaseException]) -> list[ReplicaOutcome]:
    """The outcome of each replica evicted for ``dead``'s reasons, by its index before the update."""
    return [ReplicaOutcome(replica=replica, state="evicted", version=None, resumed=False,
                           error=f"{type(error).__name__}: {error}") for replica, error in sorted(dead.items())]
