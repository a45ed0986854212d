"""weightsync's engine: one bucket pipeline for every backend, the wire codec, digests and the manager."""

from weightsync.core.codec import WIRE_VERSION, BucketHeader
from weightsync.core.digest import UpdateDigest
from weightsync.core.engine import BucketCheckpointEngine, default_node_id
from weightsync.core.host import EngineHost, engine_spec
from weightsync.core.manager import CheckpointEngineManager
from weightsync.core.planner import PackItem, PlannedBucket, plan_buckets
from weightsync.core.transport import NO_SLOT, ReceivedBucket, ReceiverTransport, SenderTransport, TransportHook

__all__ = [
    "WIRE_VERSION",
    "BucketHeader",
    "UpdateDigest",
    "BucketCheckpointEngine",
    "default_node_id",
    "EngineHost",
    "engine_spec",
    "CheckpointEngineManager",
    "PackItem",
    "PlannedBucket",
    "plan_buckets",
    "NO_SLOT",
    "ReceivedBucket",
    "ReceiverTransport",
    "SenderTransport",
    "TransportHook",
]
