"""One step of an update on many workers: await their calls together under a timeout, and type their errors.

Every driver-side caller (``CheckpointEngineManager``, the verl adapter's replica hooks) awaits workers through
:func:`gather`, so a step has one meaning everywhere: a timeout names the step and every worker still pending, and
a worker's failure — unwrapped from Ray's wrapper — is either one of our typed errors or a ``WorkerError`` naming
the worker and the step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from weightsync.api.errors import (
    HostUnreachableError, StepTimeoutError, TransferError, WeightsyncError, WorkerDiedError, WorkerError,
)
from weightsync.api.protocols import ActorWorkerGroup, RolloutWorker
from weightsync.core.worker.host import unwrap

__all__ = [
    "PROBE_TIMEOUT_S", "Labelled", "actor_calls", "actor_label", "gather", "root_cause", "timed", "timeout_of",
    "typed_error", "unreachable", "worker_calls", "worker_label",
]

Labelled = list[tuple[str, Awaitable[Any]]]
"""One step's calls, each with the worker it went to, as people read it (``actor rank 0``, ``replica1/w0``)."""

logger = logging.getLogger(__name__)

CANCEL_WAIT_S = 1.0
"""How long a step's pending calls, cancelled at its timeout, are awaited to end."""

PROBE_TIMEOUT_S = 0.5
"""How long a worker that missed a deadline has to answer a ping before its host counts as unreachable."""


def actor_label(rank: int) -> str:
    return f"actor rank {rank}"


def worker_label(replica: int, worker: RolloutWorker) -> str:
    """A rollout worker as errors name it: its replica, and its own name when it has one."""
    try:
        name = worker.name
    except Exception:  # noqa: BLE001 - a name is for people; a worker without one is still a worker
        name = ""
    return f"replica{replica}/{name}" if name else f"replica{replica}"


def actor_calls(method: str, /, *, actor_wg: ActorWorkerGroup, **per_rank: Sequence[Any]) -> Labelled:
    """``execute_checkpoint_engine(method, **per_rank)`` on every actor rank, labelled."""
    return [(actor_label(rank), call)
            for rank, call in enumerate(actor_wg.execute_checkpoint_engine(method, **per_rank))]


def worker_calls(workers: Sequence[tuple[int, RolloutWorker]], method: str, /,
                 per_worker: Sequence[Mapping[str, Any]] | None = None) -> Labelled:
    """``execute_checkpoint_engine(method, **per_worker[i])`` on every rollout worker (``(replica, worker)``),
    labelled."""
    kwargs = per_worker if per_worker is not None else [{}] * len(workers)
    return [(worker_label(r, worker), worker.execute_checkpoint_engine(method, **own))
            for (r, worker), own in zip(workers, kwargs)]


def typed_error(error: BaseException, *, step: str, worker: str) -> BaseException:
    """Our typed errors pass through (with a note naming the worker); anything else becomes a ``WorkerError``."""
    cause = unwrap(error)
    if isinstance(cause, WorkerDiedError):  # named as the manager names the worker
        return WorkerDiedError(f"{worker} died during {step}: {cause}", worker=worker, step=step)
    if isinstance(cause, WeightsyncError):
        cause.add_note(f"raised by {worker} during {step}")
        return cause
    return WorkerError(f"{worker} failed during {step}: {type(cause).__name__}: {cause}", worker=worker, step=step)


def root_cause(errors: list[BaseException]) -> BaseException:
    """Of several workers' failures in one step, the one that explains the others.

    A worker that died or crashed (``WorkerError``) comes first: its peers' transfer errors are consequences. Then a
    stripe that failed on its rail (a ``TransferError`` naming the ``rail``: the waits of the others on that stripe
    follow from it), then the senders' errors (a bad weights stream), which come first in ``errors``. The others are
    attached as notes.
    """
    # A timeout is a symptom when another worker actually failed; it is the cause only when nothing else went wrong.
    causes = [error for error in errors if not isinstance(error, StepTimeoutError)] or errors
    chosen = next((error for error in causes if isinstance(error, WorkerError)),
                  next((error for error in causes if isinstance(error, TransferError) and error.rail is not None),
                       causes[0]))
    for error in errors:
        if error is not chosen:
            chosen.add_note(f"also: {type(error).__name__}: {error}")
    return chosen


async def gather(step: str, timeout: float, labelled: Labelled,
                 *, raise_first: bool = True, fail_fast: bool = False) -> list[Any]:
    """Await every labelled awaitable under one timeout; the results in order.

    With ``raise_first`` the first failure (in order) is raised as a typed error, and a timeout raises
    ``StepTimeoutError`` naming the step and every worker still pending; otherwise failures, and that timeout error
    for the pending workers, are returned in place of results. With ``fail_fast`` (setup's steps, where nothing is
    paused yet) the first failure ends the wait a moment later (``CANCEL_WAIT_S``), the calls still pending
    cancelled, rather than at the timeout.
    """
    if not labelled:
        return []
    started = time.perf_counter()
    futures = [asyncio.ensure_future(awaitable) for _, awaitable in labelled]
    try:
        done, pending = await asyncio.wait(futures, timeout=timeout, return_when=asyncio.FIRST_EXCEPTION
                                           if fail_fast else asyncio.ALL_COMPLETED)
        if fail_fast and pending and any(not future.cancelled() and future.exception() is not None for future in done):
            # A worker failed: its peers' failures that follow from it come within a moment; the step's full
            # timeout is not waited for (a sender left waiting for a receiver that failed would hold it to the end).
            more, pending = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
            done |= more
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    errors = {future: future.exception() for future in done}  # every one retrieved: none "never retrieved"
    failed = fail_fast and any(error is not None for error in errors.values())
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("step %s: %d workers in %.3f s (%d failed, %d pending)", step, len(futures),
                     time.perf_counter() - started, sum(error is not None for error in errors.values()), len(pending))
    timed_out: StepTimeoutError | None = None
    if pending:
        for future in pending:
            future.cancel()
        # Awaited a moment, so that none is left running; one that does not end on cancellation is let be.
        ended, _ = await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
        for future in ended:
            if not future.cancelled():
                future.exception()
        names = [label for (label, _), future in zip(labelled, futures) if future in pending]
        timed_out = StepTimeoutError(
            f"step {step!r} did not finish within {timeout:g}s; still waiting for: {', '.join(names)}",
            step=step, workers=names,
        )
        if raise_first and not failed:
            raise timed_out
    results: list[Any] = []
    for (label, _), future in zip(labelled, futures):
        if future in pending:
            results.append(timed_out)  # the caller weighs it against the other workers' failures
            continue
        error = errors[future]
        if error is not None:
            if raise_first:
                raise typed_error(error, step=step, worker=label)
            results.append(error)
        else:
            results.append(future.result())
    return results


async def timed(stages: dict[str, float], step: str, timeout: float, labelled: Labelled) -> list[Any]:
    """:func:`gather` one step, recording its wall seconds in ``stages`` (also when it fails)."""
    started = time.perf_counter()
    try:
        return await gather(step, timeout, labelled)
    finally:
        stages[step] = time.perf_counter() - started


def timeout_of(labels: Sequence[str], outcomes: Sequence[Any]) -> StepTimeoutError | None:
    """``gather(raise_first=False)``'s own timeout error among its outcomes (None if nothing timed out)."""
    return next((outcome for label, outcome in zip(labels, outcomes)
                 if isinstance(outcome, StepTimeoutError) and label in outcome.workers), None)


async def unreachable(timed_out: StepTimeoutError, timeout: float, pings: Labelled,
                      where: Mapping[str, str]) -> HostUnreachableError | None:
    """After ``timed_out``: ping every worker (``pings``: one ``ping`` call each; ``where``: worker → host, from
    setup). A host none of whose workers answers within ``PROBE_TIMEOUT_S`` cannot be reached: an error naming
    those hosts, or None if every host answered through at least one worker (then the pending workers were
    waiting, or one of them is stuck on a host that is up, and the step's own timeout stands).

    A worker that answers with an error (an adapter without ``ping``) answered: its host is reachable.
    """
    answers = await gather("probe", PROBE_TIMEOUT_S, pings, raise_first=False)
    by_host: dict[str, list[str]] = {}
    answered: set[str] = set()
    for (label, _), answer in zip(pings, answers):
        host = where.get(label, f"of {label}")
        if isinstance(answer, StepTimeoutError) and answer.step == "probe":
            by_host.setdefault(host, []).append(label)
        else:
            answered.add(host)
    silent_hosts = {host: labels for host, labels in sorted(by_host.items()) if host not in answered}
    if not silent_hosts:
        return None
    described = "; ".join(f"host {host} does not answer ({', '.join(labels)} missed the deadline and a ping)"
                          for host, labels in silent_hosts.items())
    return HostUnreachableError(
        f"step {timed_out.step!r} did not finish within {timeout:g}s: {described}: its link or the host is down "
        f"(or every worker of ours on it is stuck); still waiting for: {', '.join(timed_out.workers)}",
        step=timed_out.step, workers=list(timed_out.workers), hosts=list(silent_hosts),
        unreachable=[label for labels in silent_hosts.values() for label in labels],
    )
