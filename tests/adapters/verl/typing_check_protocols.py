"""mypy-only (never executed): the verl wrappers satisfy weightsync's Protocols; the drop-in takes actor_wg by
keyword."""

from __future__ import annotations

from typing import Any

from weightsync.api.protocols import ActorWorkerGroup, RolloutReplica, RolloutWorker
from weightsync.verl import (
    CheckpointEngineManager,
    ResumingCheckpointEngineManager,
    VerlActorWorkerGroup,
    VerlRolloutReplica,
    VerlRolloutWorker,
)


def protocols_hold(actor_wg: VerlActorWorkerGroup, replica: VerlRolloutReplica, worker: VerlRolloutWorker) -> None:
    group: ActorWorkerGroup = actor_wg
    rollout: RolloutReplica = replica
    one: RolloutWorker = worker
    del group, rollout, one


def calls(config: Any, actor_wg: Any) -> None:
    CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=[])
    CheckpointEngineManager(config=config, trainer=actor_wg, replicas=[])  # type: ignore[call-arg]
    CheckpointEngineManager(config=config, actor_wg=actor_wg, trainer=actor_wg, replicas=[])  # type: ignore[call-arg]
    CheckpointEngineManager(config, actor_wg, [])  # type: ignore[call-arg]
    ResumingCheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=[])
    ResumingCheckpointEngineManager(config=config, trainer=actor_wg, replicas=[])  # type: ignore[call-arg]
    ResumingCheckpointEngineManager(  # type: ignore[call-arg]
        config=config, actor_wg=actor_wg, trainer=actor_wg, replicas=[]
    )
    # The wrapper takes the group it wraps as its one positional argument (an exemption), never by a keyword.
    VerlActorWorkerGroup(actor_wg)
    VerlActorWorkerGroup(trainer=actor_wg)  # type: ignore[call-arg]
    VerlActorWorkerGroup(actor_wg=actor_wg)  # type: ignore[call-arg]
