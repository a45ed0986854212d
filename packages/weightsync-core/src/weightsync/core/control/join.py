"""Join and catch-up: a replica added to a running manager catches up to the current version from a peer that holds
it — a committed replica's worker (``weightsync.api.peers.PeerWorker``) — not from the actor worker group, while
every other replica keeps serving.

The manager runs it before an update (or ``connect``) builds its epoch, when replicas joined since the last update:

1. the peer: the worker of a committed one-worker replica at the manager's version that holds a whole copy of it
   (a worker holding a part of the model has none; a vLLM replica's RPCs reach all its workers) — with
   ``SyncConfig.delta``, the copy its delta receiver keeps; else with ``staged``, its host's staging area, which it
   staged alone (a host's stripes, or a sharded ``actor_wg``'s streams, are in several areas);
2. a catch-up epoch of its own (setup as for an unstaged update: the manager's backend, or ``auto``'s pick): the
   peer's worker is its one actor rank (:class:`PeerGroup`, on an engine the worker keeps for it, beside its own),
   the newcomers' workers its rollout side;
3. the unstaged flow over the newcomers alone: they are paused (they enter service only once caught up), the peer
   sends the version it holds (a staged copy read back from the area, every byte hashed again), every newcomer
   verifies the peer's stream digest, and the peer's copy must be the version's — its ``TransferReport.model``, the
   model digest of a kept copy or the stream digest a staged one was staged under, equal to what the actor worker
   group reported for the version (:func:`fingerprint`) — or the catch-up fails before any newcomer is resumed;
4. a newcomer that caught up is committed at the version and resumed; one whose catch-up failed is not resumed and
   ends torn (named in ``UpdateReport.joined``): the update that follows sends it, and so everyone, in full.

Then the update builds its epoch over every replica: all hold the version, so a delta update is a delta for all,
newcomers included. Catch-up needs ``SyncConfig.delta`` or ``staged`` (something the peer serves from: a
``WeightSink`` offers ``load_weights`` only), a fingerprint of the version (an ``actor_wg`` with one sending stream,
not dealt into stripes when staged) and a peer; without them a joining replica gets the next update in full, as
does every replica (the manager logs why when the replica is added).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.api.config import SyncConfig
from weightsync.api.errors import DigestMismatchError
from weightsync.api.peers import PeerWorker
from weightsync.api.protocols import RolloutReplica
from weightsync.api.types import ReplicaOutcome, TransferReport, UpdateReport
from weightsync.core.control import steps
from weightsync.core.control.flows import Unstaged
from weightsync.core.control.round import Round
from weightsync.core.control.setup import Setup

__all__ = ["PeerGroup", "catch_up", "fingerprint", "peer_of", "why_not"]


class PeerGroup:
    """An ``ActorWorkerGroup`` of one rank: ``worker`` serving the copy of a version it holds, whose
    ``TransferReport.model`` must be ``model`` (step 3 of the module docstring)."""

    def __init__(self, worker: PeerWorker, *, label: str, model: str) -> None:
        self.worker, self.label, self.model = worker, label, model

    @property
    def world_size(self) -> int:
        return 1

    def execute_checkpoint_engine(self, method: str, /, **per_rank_kwargs: Sequence[Any]) -> Sequence[Awaitable[Any]]:
        return [self.worker.execute_as_peer(method, **{key: values[0] for key, values in per_rank_kwargs.items()})]

    def update_weights(self, *, version: int) -> Sequence[Awaitable[TransferReport]]:
        return [self._served(version)]

    async def _served(self, version: int) -> TransferReport:
        report = await self.worker.serve_weights(version=version)
        if report.model != self.model:
            raise DigestMismatchError(
                f"{self.label} served version {version} with digest {report.model[:16]}, but the actor worker "
                f"group's is {self.model[:16]}: the peer's copy is not that version", worker=self.label)
        return report


def why_not(config: SyncConfig, *, version: int, model: str) -> str:
    """Why replicas joining now cannot catch up from a peer ('' when they can, given a peer); ``model``: the
    version's :func:`fingerprint`."""
    if not (config.delta or config.staged):
        return ("catch-up from a peer needs SyncConfig(delta=True) or staged=True: no receiver keeps a copy of what "
                "it holds, nor a host's staging area")
    if version and not model:
        return ("no digest of the last version to check a peer against (an actor_wg with several sending streams, "
                "a staged update dealt into stripes, or a full update that kept no copy)")
    return ""


def fingerprint(config: SyncConfig, report: UpdateReport, *, striped: bool) -> str:
    """What a peer's copy of ``report``'s version must match (step 3): the actor worker group's model digest with
    ``delta``, else with ``staged`` its stream digest (what each host staged); '' when there is not exactly one (a
    sharded ``actor_wg``; a staged update dealt into stripes (``striped``), whose hosts staged a stripe per area)."""
    actors = [transfer for transfer in report.transfers if transfer.role == "actor" and transfer.nbytes]
    if config.delta:
        found = {transfer.model for transfer in actors if transfer.model}
    elif config.staged and len(actors) == 1 and not striped:
        found = {actors[0].digest}
    else:
        found = set()
    return next(iter(found)) if len(found) == 1 else ""


def peer_of(replicas: Sequence[RolloutReplica], states: Sequence[ReplicaOutcome], version: int, *,
            config: SyncConfig, stagers: Sequence[object]) -> tuple[str, PeerWorker] | None:
    """The peer (step 1 of the module docstring): how errors name it, and its worker; None when none can be.
    ``stagers``: the workers that staged the version alone on their host, among which the peer must be when it
    serves a staged copy (``staged`` without ``delta``; with ``delta`` it serves the copy its receiver keeps)."""
    for index, (replica, state) in enumerate(zip(replicas, states)):
        workers = list(replica.workers)
        if state.state == "committed" and state.version == version and len(workers) == 1 \
                and isinstance(workers[0], PeerWorker) and (config.delta or any(workers[0] is w for w in stagers)):
            return f"{steps.worker_label(index, workers[0])} (peer)", workers[0]
    return None


async def catch_up(newcomers: Sequence[RolloutReplica], peer: tuple[str, PeerWorker], *, setup: Setup, version: int,
                   model: str, previous: Sequence[ReplicaOutcome]) -> tuple[list[ReplicaOutcome], float]:
    """Steps 2-4 of the module docstring for ``newcomers`` (``previous``: their outcomes before): each one's outcome
    and the seconds it took. ``setup``: the manager's, whose backend and configuration the catch-up epoch takes."""
    started = time.perf_counter()
    label, worker = peer
    group = PeerGroup(worker, label=label, model=model)
    own = Setup(actor_wg=group, backend=setup.backend, engine_class=setup.engine_class,
                config=dataclasses.replace(setup.config, staged=False))
    flow = Unstaged(actor_wg=group, timeouts=setup.config.timeouts, setup=own)
    round_ = Round.of(version, newcomers)
    # Paused, a newcomer enters service only caught up: to the flow it holds nothing it may serve, so one whose
    # catch-up failed, even before a byte reached it (a peer that refused), stays paused and torn.
    unserved = [dataclasses.replace(outcome, state="torn", version=None) for outcome in previous]
    try:
        epoch = await own.build(round_.stages, round_.workers, flow, states=(), version=version)
        round_.stripes, round_.sources = epoch.stripes, epoch.sources
        await flow.run(round_, epoch, unserved)
    except Exception as exc:  # noqa: BLE001 - a failed catch-up leaves its newcomers torn, named; the update repairs
        round_.failure = round_.failure or exc
    finally:
        await steps.gather("close", setup.config.timeouts.finalize, steps.actor_calls("close", actor_wg=group),
                           raise_first=False)  # the peer's engine for it: its buffers go
    outcomes = round_.outcomes(unserved)  # one never paused (the catch-up's setup failed) is as it was
    return [outcome if r in round_.paused_at else previous[r] for r, outcome in enumerate(outcomes)], \
        time.perf_counter() - started
