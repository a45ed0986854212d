"""The replica steps every update flow is built from, written once: pause; resume unless torn (and tell the torn);
prove the load and disown a replica that disagrees. Each records what it did in the :class:`Round`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from weightsync.api.config import StepTimeouts
from weightsync.api.errors import LoadVerificationError
from weightsync.api.protocols import LoadProvingReplica, PausableReplica, RolloutReplica, TornAwareReplica
from weightsync.api.types import ReplicaOutcome
from weightsync.core.control import steps
from weightsync.core.control.round import Round

__all__ = ["checksums", "disagreeing", "disowning", "pause", "settle", "tell_torn"]


async def _pause(replica: RolloutReplica) -> None:
    if isinstance(replica, PausableReplica):  # both hooks in one round trip
        await replica.pause()
        return
    await replica.abort_all_requests()
    await replica.release_kv_cache()


async def _resume(replica: RolloutReplica) -> None:
    if isinstance(replica, PausableReplica):
        await replica.resume()
        return
    await replica.resume_kv_cache()
    await replica.resume_generation()


async def pause(round_: Round, indices: Sequence[int], timeout: float, *, raise_first: bool = True) -> list[object]:
    """Pause replicas ``indices`` (each from now on counts as paused in its outcome's ``pause_seconds``); with
    ``raise_first`` the first failure raises (``steps.gather``), else each replica's result or error is returned.
    A replica an earlier round of this update left paused (``Round.held``) is not paused again (its result: None)."""
    started = time.perf_counter()
    for r in indices:
        round_.paused_at.setdefault(r, started)
        round_.resumed[r] = False
    calls: steps.Labelled = [(f"replica{r}", _pause(round_.replicas[r])) for r in indices if r not in round_.held]
    try:
        results = iter(await steps.gather("pause", timeout, calls, raise_first=raise_first))
        return [None if r in round_.held else next(results) for r in indices]
    finally:
        round_.stages["pause"] = max(round_.stages.get("pause", 0.0), time.perf_counter() - started)


async def settle(round_: Round, indices: Sequence[int], previous: Sequence[ReplicaOutcome], timeouts: StepTimeouts,
                 *, cause: BaseException | None = None) -> BaseException | None:
    """After replicas ``indices`` took their update (or failed to): resume each that is not torn, by the round's
    one rule (:meth:`Round.state_of`); tell each torn one (``TornAwareReplica.torn``: it ends the requests it kept;
    ``cause``: why, if not the round's failure) and leave it paused. Returns the resume's error, if it failed (those
    replicas stay paused, ``resumed`` False)."""
    states = {r: round_.state_of(r, previous[r])[0] for r in indices}
    await tell_torn(round_, [r for r in indices if states[r] == "torn"], timeouts.resume, cause=cause)
    resumable = [r for r in indices if states[r] != "torn"]
    started = time.perf_counter()
    failure: BaseException | None = None
    try:
        await steps.gather("resume", timeouts.resume, [(f"replica{r}", _resume(round_.replicas[r]))
                                                        for r in resumable])
    except BaseException as exc:  # they stay paused, and their outcomes say so
        failure = exc
    round_.stages["resume"] = max(round_.stages.get("resume", 0.0), time.perf_counter() - started)
    now = time.perf_counter()
    for r in resumable:
        round_.resumed[r] = failure is None
        if failure is None and r in round_.paused_at:
            round_.timing.setdefault(r, {})["pause"] = now - round_.paused_at[r]
    return failure


async def tell_torn(round_: Round, indices: Sequence[int], timeout: float, *, cause: BaseException | None = None
                    ) -> None:
    """``torn(reason)`` on every replica of ``indices`` that has it (``reason``: ``cause``, else the round's
    failure); best effort: it stays paused whatever it answers."""
    failure = cause if cause is not None else round_.failure
    reason = f"{type(failure).__name__}: {failure}" if failure is not None else "the update did not complete"
    calls: steps.Labelled = []
    for r in indices:
        replica = round_.replicas[r]
        if isinstance(replica, TornAwareReplica):
            calls.append((f"replica{r}", replica.torn(reason)))
    if calls:
        await steps.gather("resume", timeout, calls, raise_first=False)


async def checksums(round_: Round, indices: Sequence[int], timeout: float, *, at_least: int = 1
                    ) -> dict[int, dict[str, str]]:
    """What each ``LoadProvingReplica`` of ``indices`` holds now (its engine's checksums, per parameter); none asked
    for when fewer than ``at_least`` of them can give them."""
    provers: list[tuple[int, LoadProvingReplica]] = []
    for r in indices:
        replica = round_.replicas[r]
        if isinstance(replica, LoadProvingReplica):
            provers.append((r, replica))
    if len(provers) < at_least:
        return {}
    started = time.perf_counter()
    try:
        held = await steps.gather("verify_load", timeout, [
            (f"replica{r}", replica.weight_checksums()) for r, replica in provers])
    finally:
        round_.stages["verify_load"] = max(round_.stages.get("verify_load", 0.0), time.perf_counter() - started)
    return {r: dict(sums) for (r, _), sums in zip(provers, held)}


def disagreeing(held: Sequence[tuple[int, Mapping[str, str]]]) -> dict[int, str]:
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


def disowning(round_: Round, held: Mapping[int, Mapping[str, str]]) -> LoadVerificationError | None:
    """The proof of load over ``held`` (replica index → its checksums; fewer than two prove nothing): the replicas
    that hold another value than the majority are disowned (``round_.disowned``: their outcome is torn) and the
    error names the first of them; None when all agree."""
    if len(held) < 2:
        return None
    wrong = disagreeing(sorted(held.items()))
    if not wrong:
        return None
    round_.disowned.update(wrong)
    first = min(wrong)
    parameter = wrong[first]
    return LoadVerificationError(
        f"replica{first}'s engine holds another {parameter!r} than "
        f"{'the other replicas' if len(wrong) < len(held) else 'the replica(s) it was compared with'}"
        f" after the update (replicas disagreeing: {sorted(wrong)})", replica=f"replica{first}", parameter=parameter)
