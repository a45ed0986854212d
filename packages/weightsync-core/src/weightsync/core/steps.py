"""One step of an update on many workers: await their calls together under a timeout, and type their errors.

Every driver-side caller (``CheckpointEngineManager``, the verl adapter's replica hooks) awaits workers through
:func:`gather`, so a step has one meaning everywhere: a timeout names the step and every worker still pending, and
a worker's failure — unwrapped from Ray's wrapper — is either one of our typed errors or a ``WorkerError`` naming
the worker and the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from weightsync.api.errors import StepTimeoutError, WeightsyncError, WorkerError

__all__ = ["gather", "root_cause", "typed_error", "unwrap"]


def unwrap(error: BaseException) -> BaseException:
    """Ray wraps a remote exception; its ``cause`` is the one the worker raised."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def typed_error(error: BaseException, *, step: str, worker: str) -> BaseException:
    """Our typed errors pass through (with a note naming the worker); anything else becomes a ``WorkerError``."""
    cause = unwrap(error)
    if isinstance(cause, WeightsyncError):
        cause.add_note(f"raised by {worker} during {step}")
        return cause
    return WorkerError(f"{worker} failed during {step}: {type(cause).__name__}: {cause}", worker=worker, step=step)


def root_cause(errors: list[BaseException]) -> BaseException:
    """Of several workers' failures in one step, the one that explains the others.

    A worker that died or crashed (``WorkerError``) comes first: its peers' transfer errors are consequences. Then
    the senders' errors (a bad weights stream), which come first in ``errors``. The others are attached as notes.
    """
    # A timeout is a symptom when another worker actually failed; it is the cause only when nothing else went wrong.
    causes = [error for error in errors if not isinstance(error, StepTimeoutError)] or errors
    chosen = next((error for error in causes if isinstance(error, WorkerError)), causes[0])
    for error in errors:
        if error is not chosen:
            chosen.add_note(f"also: {type(error).__name__}: {error}")
    return chosen


async def gather(step: str, timeout: float, labelled: list[tuple[str, Awaitable[Any]]],
                 *, raise_first: bool = True) -> list[Any]:
    """Await every labelled awaitable under one timeout; the results in order.

    With ``raise_first`` the first failure (in order) is raised as a typed error, and a timeout raises
    ``StepTimeoutError`` naming the step and every worker still pending; otherwise failures, and that timeout error
    for the pending workers, are returned in place of results.
    """
    if not labelled:
        return []
    futures = [asyncio.ensure_future(awaitable) for _, awaitable in labelled]
    try:
        _done, pending = await asyncio.wait(futures, timeout=timeout)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    timed_out: StepTimeoutError | None = None
    if pending:
        for future in pending:
            future.cancel()
        names = [label for (label, _), future in zip(labelled, futures) if future in pending]
        timed_out = StepTimeoutError(
            f"step {step!r} did not finish within {timeout:g}s; still waiting for: {', '.join(names)}",
            step=step, workers=names,
        )
        if raise_first:
            raise timed_out
    results: list[Any] = []
    for (label, _), future in zip(labelled, futures):
        if future in pending:
            results.append(timed_out)  # the caller weighs it against the other workers' failures
            continue
        error = future.exception()
        if error is not None:
            if raise_first:
                raise typed_error(error, step=step, worker=label)
            results.append(error)
        else:
            results.append(future.result())
    return results
