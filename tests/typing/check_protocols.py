"""mypy-only: our implementations satisfy the Protocols structurally (never executed)."""

from __future__ import annotations

from weightsync.api.protocols import ActorWorkerGroup, CheckpointEngine, RolloutReplica, RolloutWorker
from weightsync.gloo.collective import GlooCheckpointEngine
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica, RayRolloutWorker
from weightsync.shm.engine import ShmCheckpointEngine


def protocols_hold(actor_wg: RayActorWorkerGroup, replica: RayRolloutReplica, worker: RayRolloutWorker) -> None:
    group: ActorWorkerGroup = actor_wg
    rollout: RolloutReplica = replica
    one: RolloutWorker = worker
    engines: list[type[CheckpointEngine]] = [ShmCheckpointEngine, GlooCheckpointEngine]
    shm: CheckpointEngine = ShmCheckpointEngine(bucket_bytes=1 << 20)
    del group, rollout, one, engines, shm
