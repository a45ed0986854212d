"""mypy-only (never executed): the verl wrappers satisfy weightsync's Protocols; the drop-in takes actor_wg by keyword."""

from __future__ import annotations

from typing import Any

from weightsync.api.protocols import ActorWorkerGroup, RolloutReplica, RolloutWorker
from weightsync.verl import CheckpointEngineManager, VerlActorWorkerGroup, VerlRolloutReplica, VerlRolloutWorker


def protocols_hold(actor_wg: VerlActorWorkerGroup, replica: VerlRolloutReplica, worker: VerlRolloutWorker) -> None:
    group: ActorWorkerGroup = actor_wg
    rollout: RolloutReplica = replica
    one: RolloutWorker = worker
    del group, rollout, one


def calls(config: Any, actor_wg: Any) -> None:
    CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=[])
    CheckpointEngineManager(config=config, trainer=actor_wg, replicas=[])  # type: ignore[call-arg]
    CheckpointEngineManager(config, actor_wg, [])  # type: ignore[call-arg]
