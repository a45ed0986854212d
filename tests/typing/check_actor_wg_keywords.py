"""mypy-only: the actor_wg keywords are keyword-only, and the old spellings do not type-check.

Each wrong call carries ``# type: ignore[call-arg]``; with ``warn_unused_ignores`` a loosened signature (one that
accepts the wrong call) makes the ignore unused, and mypy fails the build. Never executed.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import assert_type

from weightsync.api.topology import build_checked_topology, with_epoch
from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.gloo.collective import GlooCheckpointEngine
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica
from weightsync.shm.engine import ShmCheckpointEngine


def correct(actor_wg: RayActorWorkerGroup, replicas: list[RayRolloutReplica], metadata: WorldMetadata) -> None:
    manager = CheckpointEngineManager(backend="shm", actor_wg=actor_wg, replicas=replicas)
    assert_type(manager, CheckpointEngineManager)
    topology = ShmCheckpointEngine.build_topology(actor_wg_world_size=2, rollout_world_size=4, metadata=metadata)
    assert_type(topology, Topology)
    assert_type(
        GlooCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata), Topology
    )
    checked = build_checked_topology(
        ShmCheckpointEngine, backend="shm", actor_wg_world_size=2, rollout_world_size=4, metadata=metadata
    )
    assert_type(with_epoch(checked), Topology)


def wrong(actor_wg: RayActorWorkerGroup, replicas: list[RayRolloutReplica], metadata: WorldMetadata) -> Any:
    CheckpointEngineManager(backend="shm", trainer=actor_wg, replicas=replicas)  # type: ignore[call-arg]
    # Both keywords: an __init__ with **kwargs would accept this one (the hole this case keeps closed).
    CheckpointEngineManager(  # type: ignore[call-arg]
        backend="shm", actor_wg=actor_wg, trainer=actor_wg, replicas=replicas
    )
    CheckpointEngineManager("shm", actor_wg, replicas)  # type: ignore[call-arg]
    ShmCheckpointEngine.build_topology(  # type: ignore[call-arg]
        trainer_world_size=2, rollout_world_size=4, metadata=metadata
    )
    ShmCheckpointEngine.build_topology(2, 4, metadata)  # type: ignore[call-arg]
    GlooCheckpointEngine.build_topology(  # type: ignore[call-arg]
        trainer_world_size=1, rollout_world_size=1, metadata=metadata
    )
    build_checked_topology(  # type: ignore[call-arg]
        ShmCheckpointEngine, backend="shm", trainer_world_size=2, rollout_world_size=4, metadata=metadata
    )
    build_checked_topology(ShmCheckpointEngine, "shm", 2, 4, metadata)  # type: ignore[call-arg]
