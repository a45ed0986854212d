"""What a backend builds on: the one module of weightsync-core that backend packages import.

A backend is a :class:`Transport` (its buffers, connections and topology; where its buffers live) turned into an
engine class by :func:`engine_class`, plus a ``BackendSpec`` in its own ``spec`` module for the registry. It may
build its transport on the shared ones here — the chain of one-sided reads (:class:`ChainTransport`, nixl and
mooncake), the broadcast over a private process group (:class:`GroupTransport`) on host buffers
(:class:`CollectiveTransport`, gloo) and on device streams (:class:`AcceleratorCollectiveTransport`, nccl and
hccl) — or implement the
``CheckpointEngine`` Protocol itself on the pieces below (kimi). ``docs/ARCHITECTURE.md`` walks through it.
"""

from weightsync.core.transports.chain.transport import (
    DEFAULT_FANOUT,
    ChainTransport,
    RegisteredRing,
    RemoteRing,
    RingEndpoint,
    chain_positions,
)
from weightsync.core.transports.collective.group import Group, GroupTransport, c10d, gloo_group
from weightsync.core.transports.collective.host import CollectiveTransport
from weightsync.core.transports.chain.rings import PendingRead
from weightsync.core.wire.codec import WIRE_VERSION, Ack, Hello, encode
from weightsync.core.transports.device import (
    AcceleratorOps,
    AcceleratorPolicy,
    accepted_devices,
    process_accelerator,
    wait_event,
)
from weightsync.core.worker.engine import BucketCheckpointEngine, engine_class, guard_build_topology
from weightsync.core.pipeline.handover import Handover, Hold
from weightsync.core.pipeline.planner import validate_pair
from weightsync.core.transports.collective.device import AcceleratorCollectiveTransport, node_local_plan
from weightsync.core.transports.place import default_node_id
from weightsync.core.transports.plan import Idle, RankPlan, RankRole, decode_metadata, decode_plan, encode_plan
from weightsync.core.transports.settings import EngineBase, EngineMetadata, EngineSettings
from weightsync.core.transports.sharedmem import SharedSegment, new_segment_prefix, sweep_orphan_segments, too_small
from weightsync.core.transports.sources import SourcesPlan, SourcesReceiver, plan_sources
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.framing import accept_peers, recv_frame, send_frame
from weightsync.core.wire.tensors import as_byte_view, dtype_name, memoryview_of
from weightsync.core.transports.device import DevicePolicy
from weightsync.core.transports.seam import BufferPlace, NO_SLOT, ReceivedBucket, ReceiverTransport, SenderTransport
from weightsync.core.transports.transport import Transport
from weightsync.core.transports.waiting import AckedPeers, FreeSlots, SlotSequence, poll_until

__all__ = [
    # the engine and its settings
    "BucketCheckpointEngine", "engine_class", "guard_build_topology", "EngineBase", "EngineSettings",
    "default_node_id",
    # the transport interface
    "Transport", "SenderTransport", "ReceiverTransport", "ReceivedBucket", "NO_SLOT", "BufferPlace", "DevicePolicy",
    # the typed plan: what build_topology hands each rank, and what a worker advertises
    "RankPlan", "RankRole", "Idle", "encode_plan", "decode_plan", "decode_metadata", "EngineMetadata",
    # shared transports
    "ChainTransport", "RegisteredRing", "RemoteRing", "PendingRead", "RingEndpoint", "chain_positions", "DEFAULT_FANOUT",
    "GroupTransport", "CollectiveTransport", "Group", "c10d", "gloo_group",
    "AcceleratorCollectiveTransport", "AcceleratorOps", "AcceleratorPolicy", "process_accelerator",
    "accepted_devices", "node_local_plan", "wait_event",
    # control plane and waiting
    "WIRE_VERSION", "Hello", "Ack", "encode", "accept_peers", "send_frame", "recv_frame", "AckedPeers",
    "FreeSlots", "SlotSequence", "poll_until", "Handover", "Hold",
    # a sharded actor_wg: who sends what, and the receiver of every sender's stream
    "SourcesPlan", "SourcesReceiver", "plan_sources",
    # shared memory on one host
    "SharedSegment", "new_segment_prefix", "sweep_orphan_segments", "too_small",
    # tensors and digests
    "validate_pair", "as_byte_view", "dtype_name", "memoryview_of", "UpdateDigest",
]
