"""Eviction within an update: a replica that dies during an update leaves it, and the update still commits every
other replica in the same ``update_weights`` call.

When an update's flow fails, every worker is pinged (``health.dead_workers``: dead is ``WorkerDiedError`` or no
answer within ``PING_S``: a worker that missed its step's deadline and stays silent — a stopped process, a host or
link gone — is dead too; a live worker busy in a step still answers, Ray actors being concurrent; after a
``HostUnreachableError`` its silent workers are the dead, the flow having probed every worker already). The update
fails as a whole, as it would without eviction, when no rollout worker is dead (a failure that is not a death: a
digest mismatch, a lost rail), when an actor rank is dead or silent (the sender dying fails the update), or when
evicting the dead would exceed ``SyncConfig.max_evicted`` (those evicted before the update count too) or leave no
replica. Otherwise:

1. each replica with a dead worker is evicted (``Round.lost``; ``UpdateReport.evicted`` names it and why) and leaves
   the membership; one the failed round tore is never resumed;
2. a second transfer (``Round.retry``) runs in the same call over the survivors that do not hold the version: those
   the first round tore (still paused: not paused again) and those it never reached (serving their old version; a
   staged retry restages while they serve). Its epoch is built over them only and its update is full — what a torn
   receiver holds is no base. Survivors that committed stay out, serving;
3. the manager's next update builds an epoch over every survivor: each holds the version, committed, so that update
   is a delta where it was one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from weightsync.api.errors import HostUnreachableError
from weightsync.api.types import ReplicaOutcome
from weightsync.core.control import health, steps
from weightsync.core.control.round import Round

__all__ = ["PING_S", "lost_replicas", "retry_of"]

PING_S = 2.0
"""How long each worker has to answer the ping after a failed update (at most ``timeouts.setup``): the failure took
its own time already, and a worker of ours answers a ping in milliseconds."""


async def lost_replicas(round_: Round, failure: BaseException, pings: steps.Labelled, actor_size: int,
                        timeout: float) -> dict[int, BaseException]:
    """Replica index → why it died, after ``round_`` failed with ``failure`` (``pings``: a ping to every worker, the
    ``actor_size`` actor ranks first; ``timeout``: ``timeouts.setup``); {} when no rollout worker is dead, or when an
    actor rank is. A ``HostUnreachableError`` names the silent workers already (the flow probed every worker): they
    are the dead, with no second ping."""
    if isinstance(failure, HostUnreachableError):
        dead: dict[str, BaseException] = {label: failure for label in failure.unreachable}
    else:
        started = time.perf_counter()
        try:
            dead = await health.dead_workers(pings, min(timeout, PING_S), during="the update")
        finally:
            round_.stages["evict"] = time.perf_counter() - started
    if not dead or any(label in dead for label, _ in pings[:actor_size]):
        return {}
    return health.replicas_of(round_.workers, pings[actor_size:], dead)


def retry_of(round_: Round, lost: dict[int, BaseException], previous: Sequence[ReplicaOutcome]
             ) -> tuple[Round, list[ReplicaOutcome]] | None:
    """Evict ``lost`` from ``round_`` (``previous``: each replica's outcome before it) and return the round of the
    second transfer over the survivors that lack the version, with their outcomes after the first; None when every
    survivor committed."""
    round_.lost.update(lost)
    round_.evicted.extend(health.evicted_outcomes(lost))
    first = round_.own_outcomes(previous)
    retried = [r for r, outcome in enumerate(first) if r not in lost
               and (outcome.state, outcome.version) != ("committed", round_.version)]
    if not retried:
        return None
    retry = Round.of(round_.version, [round_.replicas[r] for r in retried])
    retry.held = {i for i, r in enumerate(retried) if r in round_.paused_at and not round_.resumed.get(r)}
    retry.paused_at = {i: round_.paused_at[r] for i in retry.held for r in [retried[i]]}
    round_.retry, round_.retried = retry, retried
    return retry, [first[r] for r in retried]
