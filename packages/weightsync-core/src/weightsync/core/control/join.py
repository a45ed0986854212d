"""Join and catch-up: a replica added to a running manager catches up to the current version from a peer that holds
it — a committed replica's worker, serving the copy its delta receiver keeps (``weightsync.api.peers.PeerWorker``)
— not from the actor worker group, while every other replica keeps serving.

The manager runs it before an update (or ``connect``) builds its epoch, when replicas joined since the last update:

1. the peer: the first worker of a committed replica at the manager's version that is a ``PeerWorker``, in a
   replica of one worker (a worker holding a part of the model has no whole copy to serve);
2. a catch-up epoch of its own (setup as for an update: the manager's backend, or ``auto``'s pick): the peer's
   worker is its one actor rank (:class:`PeerGroup`, on an engine the worker keeps for it, beside its own), the
   newcomers' workers its rollout side;
3. the unstaged flow over the newcomers alone: they are paused (they enter service only once caught up), the peer
   sends the version it keeps in the same buckets the actor worker group sent, every newcomer verifies the peer's
   stream digest, and the peer's model digest must be the version's (what the actor worker group reported for it,
   ``TransferReport.model``) or the catch-up fails before any newcomer is resumed;
4. a newcomer that caught up is committed at the version and resumed; one whose catch-up failed is not resumed and
   ends torn (named in ``UpdateReport.joined``): the update that follows sends it, and so everyone, in full.

Then the update builds its epoch over every replica: all hold the version, so it is a delta for all, newcomers
included. Catch-up needs ``SyncConfig.delta`` (a receiver keeps a copy of what it holds only then) without
``staged`` (not built: nor serving from a host's staging area), an ``actor_wg`` with one sending stream (not
sharded) and a committed peer; without them a joining replica gets the
next update in full, as does every replica (the manager logs why when the replica is added).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import Any

from weightsync.api.config import SyncConfig
from weightsync.api.errors import DigestMismatchError
from weightsync.api.peers import PeerWorker
from weightsync.api.protocols import RolloutReplica
from weightsync.api.types import ReplicaOutcome, TransferReport
from weightsync.core.control import steps
from weightsync.core.control.flows import Unstaged
from weightsync.core.control.round import Round
from weightsync.core.control.setup import Setup

__all__ = ["PeerGroup", "catch_up", "peer_of", "why_not"]


class PeerGroup:
    """An ``ActorWorkerGroup`` of one rank: ``worker`` serving the copy of a version it keeps, whose model digest must
    be ``model`` (step 3 of the module docstring)."""

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
                f"{self.label} served version {version} with model digest {report.model[:16]}, but the actor worker "
                f"group's is {self.model[:16]}: the peer's copy is not that version", worker=self.label)
        return report


def why_not(config: SyncConfig, *, version: int, model: str) -> str:
    """Why replicas joining now cannot catch up from a peer ('' when they can, given a peer)."""
    if not config.delta:
        return "catch-up from a peer needs SyncConfig(delta=True): no receiver keeps a copy of what it holds"
    if config.staged:
        return "catch-up from a peer is not built for staged updates (nor from a host's staging area)"
    if version and not model:
        return ("no model digest of the last version to check a peer against (an actor_wg with several sending "
                "streams, or a full update that kept no copy)")
    return ""


def peer_of(replicas: Sequence[RolloutReplica], states: Sequence[ReplicaOutcome], version: int
            ) -> tuple[str, PeerWorker] | None:
    """The peer (step 1 of the module docstring): how errors name it, and its worker; None when none can be."""
    for index, (replica, state) in enumerate(zip(replicas, states)):
        workers = list(replica.workers)
        if state.state == "committed" and state.version == version and len(workers) == 1 \
                and isinstance(workers[0], PeerWorker):
            return f"{steps.worker_label(index, workers[0])} (peer)", workers[0]
    return None


async def catch_up(newcomers: Sequence[RolloutReplica], peer: tuple[str, PeerWorker], *, setup: Setup, version: int,
                   model: str, previous: Sequence[ReplicaOutcome]) -> tuple[list[ReplicaOutcome], float]:
    """Steps 2-4 of the module docstring for ``newcomers`` (``previous``: their outcomes before): each one's outcome
    and the seconds it took. ``setup``: the manager's, whose backend and configuration the catch-up epoch takes."""
    started = time.perf_counter()
    label, worker = peer
    group = PeerGroup(worker, label=label, model=model)
    own = Setup(actor_wg=group, backend=setup.backend, engine_class=setup.engine_class, config=setup.config)
    flow = Unstaged(actor_wg=group, timeouts=setup.config.timeouts, setup=own)
    round_ = Round.of(version, newcomers)
    try:
        epoch = await own.build(round_.stages, round_.workers, flow, states=(), version=version)
        round_.stripes, round_.sources = epoch.stripes, epoch.sources
        await flow.run(round_, epoch, previous)
    except Exception as exc:  # noqa: BLE001 - a failed catch-up leaves its newcomers torn, named; the update repairs
        round_.failure = round_.failure or exc
    finally:
        await steps.gather("close", setup.config.timeouts.finalize, steps.actor_calls("close", actor_wg=group),
                           raise_first=False)  # the peer's engine for it: its buffers go
    return round_.outcomes(previous), time.perf_counter() - started
