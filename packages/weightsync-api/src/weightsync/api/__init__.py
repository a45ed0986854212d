"""weightsync's interface: Protocols, value types, configuration, typed errors and the backend registry.

This package depends on ``typing-extensions`` only; torch and ray appear in annotations alone. Start with
:mod:`weightsync.api.protocols`, which holds the lifecycle contract every engine and adapter follows.
"""

from importlib.metadata import version as _version

from weightsync.api import errors
from weightsync.api.config import BUCKET_ALIGNMENT, MiB, StepTimeouts, SyncConfig
from weightsync.api.parts import PART_KEY, Part, Region
from weightsync.api.sources import SOURCE_KEY, Holding, Shard, ShardedWeightSource, SourceLayout
from weightsync.api.protocols import (
    ActorWorkerGroup,
    BatchedWeights,
    CheckpointEngine,
    ReceivedWeights,
    copy_stream_into,
    load_into,
    LoadProvingReplica,
    PausableReplica,
    TornAwareReplica,
    RolloutReplica,
    RolloutWorker,
    StagingWorker,
    WeightSink,
    WeightSource,
)
from weightsync.api.registry import (
    BackendSpec,
    BackendStatus,
    available_backends,
    backend_statuses,
    get_backend_spec,
    installed_backends,
    load_engine_class,
    register_backend,
)
from weightsync.api.topology import build_checked_topology, with_epoch
from weightsync.api.types import (
    JsonValue,
    RankArgs,
    ReplicaOutcome,
    Received,
    ReplicaState,
    Role,
    StagedUpdate,
    PhaseTiming,
    Topology,
    TransferReport,
    UpdateReport,
    WorkerContext,
    WorkerMetadata,
    WorldMetadata,
)

__version__ = _version("weightsync-api")
"""This distribution's version (from its installed metadata)."""

__all__ = [
    "errors",
    "BUCKET_ALIGNMENT",
    "MiB",
    "StepTimeouts",
    "SyncConfig",
    "PART_KEY",
    "Part",
    "Region",
    "SOURCE_KEY",
    "Holding",
    "Shard",
    "SourceLayout",
    "ShardedWeightSource",
    "ActorWorkerGroup",
    "CheckpointEngine",
    "ReceivedWeights",
    "BatchedWeights",
    "copy_stream_into",
    "load_into",
    "RolloutReplica",
    "LoadProvingReplica",
    "PausableReplica",
    "TornAwareReplica",
    "RolloutWorker",
    "StagingWorker",
    "WeightSink",
    "WeightSource",
    "BackendSpec",
    "BackendStatus",
    "available_backends",
    "backend_statuses",
    "get_backend_spec",
    "installed_backends",
    "load_engine_class",
    "register_backend",
    "build_checked_topology",
    "with_epoch",
    "JsonValue",
    "RankArgs",
    "ReplicaOutcome",
    "Received",
    "ReplicaState",
    "Role",
    "StagedUpdate",
    "PhaseTiming",
    "Topology",
    "TransferReport",
    "UpdateReport",
    "WorkerContext",
    "WorkerMetadata",
    "WorldMetadata",
]
