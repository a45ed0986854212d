"""weightsync's engine: one bucket pipeline for every backend, the wire codec, digests and the manager.

The sub-packages follow the data path, top to bottom (``docs/ARCHITECTURE.md`` walks them): ``control`` (the
manager and its update flows), ``worker`` (a worker's host and engine), ``pipeline`` (plan, pack, stage, send; receive,
unpack), ``delta`` (changes against a base), ``transports`` (the seam and the ways buckets move), ``wire`` (what
crosses: codec, framing, digest, tensors as bytes) and ``native`` (the compiled helper). A module imports only its own
layer and those below. Backends import ``weightsync.core.backend`` alone. The names below are imported on first use, not with the package.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

__version__ = _version("weightsync-core")
"""This distribution's version (from its installed metadata)."""

if TYPE_CHECKING:  # the names as mypy sees them (re-exported)
    from weightsync.core.worker.engine import BucketCheckpointEngine as BucketCheckpointEngine
    from weightsync.core.worker.host import EngineHost as EngineHost
    from weightsync.core.worker.host import engine_spec as engine_spec
    from weightsync.core.worker.sources import ModuleShards as ModuleShards
    from weightsync.core.control.manager import CheckpointEngineManager as CheckpointEngineManager
    from weightsync.core.pipeline.planner import plan_buckets as plan_buckets
    from weightsync.core.transports.place import default_node_id as default_node_id
    from weightsync.core.transports.seam import NO_SLOT as NO_SLOT
    from weightsync.core.transports.seam import ReceivedBucket as ReceivedBucket
    from weightsync.core.transports.seam import ReceiverTransport as ReceiverTransport
    from weightsync.core.transports.seam import SenderTransport as SenderTransport
    from weightsync.core.transports.settings import TransportHook as TransportHook
    from weightsync.core.wire.codec import BucketHeader as BucketHeader
    from weightsync.core.wire.codec import WIRE_VERSION as WIRE_VERSION
    from weightsync.core.wire.digest import UpdateDigest as UpdateDigest
    from weightsync.core.wire.layout import PackItem as PackItem
    from weightsync.core.wire.layout import PlannedBucket as PlannedBucket

_WHERE = {
    "WIRE_VERSION": "wire.codec", "BucketHeader": "wire.codec", "UpdateDigest": "wire.digest",
    "BucketCheckpointEngine": "worker.engine", "default_node_id": "transports.place",
    "EngineHost": "worker.host", "engine_spec": "worker.host", "ModuleShards": "worker.sources",
    "CheckpointEngineManager": "control.manager",
    "PackItem": "wire.layout", "PlannedBucket": "wire.layout", "plan_buckets": "pipeline.planner",
    "NO_SLOT": "transports.seam", "ReceivedBucket": "transports.seam",
    "ReceiverTransport": "transports.seam", "SenderTransport": "transports.seam",
    "TransportHook": "transports.settings",
}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
