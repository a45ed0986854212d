"""The collective transport on device buckets, shared by NCCL (CUDA) and HCCL (Ascend).

A sibling of the host family (:mod:`~weightsync.core.transports.collective.host`): both are
:class:`~weightsync.core.transports.collective.group.GroupTransport` objects (a private ``PrefixStore(TCPStore)`` group
per epoch, its topology and plans); what this one has of its own:

* **Device buckets.** Both rings (sender and receiver) live in device memory, allocated once per engine and touched
  at allocation. Receivers receive straight into them and yield views of them: no host bounce for the weights.
* **Streams and events** (:mod:`weightsync.core.transports.device`): packing on the policy's copy stream, broadcasts on a
  *communication stream*. Per slot, a ``packed`` event (copy → comm: the broadcast may start) and a ``sent`` event
  (comm → copy: the slot may be overwritten); receivers record a ``consumed`` event on the consumer's stream when it
  releases a bucket, and the next broadcast into that slot waits for it on the device.
* **Node-local senders** (option ``relays="node"``; default ``"none"``). With ``"none"`` actor rank 0 broadcasts to
  every rollout worker in one group (verl's design). With ``"node"`` the first actor rank of each node sends to the
  rollout workers of its own node, in a group per node, so the model crosses no inter-node link at all when actor
  and rollout share nodes (colocated / hybrid engine); rollout workers on nodes without an actor rank join actor
  rank 0's group. Every sender sends the *whole* model, so this needs every actor rank's weights stream to yield
  full tensors (true of verl's FSDP and Megatron per-tensor generators, which all-gather to every rank).

The tests run the same code on an emulated accelerator with a gloo group standing in for NCCL (tests/backends/nccl);
device instances supply :class:`~weightsync.core.transports.device.AcceleratorOps` and a group class.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch

from weightsync.api.errors import BackendUnavailableError, ConfigError, TopologyError, TransferError
from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.transports.collective.group import (
    MAX_HEADER_BYTES,
    Group,
    GroupMetadata,
    GroupReceive,
    GroupSend,
    GroupTransport,
    c10d,
)
from weightsync.core.transports.device import AcceleratorOps, AcceleratorPolicy, DevicePolicy, wait_event
from weightsync.core.transports.plan import Idle, RankPlan, decode_metadata, encode_plan
from weightsync.core.transports.seam import NO_SLOT, BufferPlace, ReceivedBucket
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.waiting import FreeSlots
from weightsync.core.wire.tensors import memoryview_of

__all__ = [
    "RELAY_MODES", "Relays", "AcceleratorCollectiveTransport", "StreamedSender", "StreamedReceiver",
    "node_local_plan",
]

Relays = Literal["none", "node"]
RELAY_MODES: tuple[Relays, ...] = ("none", "node")


# -- transports -------------------------------------------------------------------------------------------------------


class StreamedSender:
    """The collective sender on device buckets: broadcasts on the comm stream, ordered by per-slot events."""

    def __init__(self, group: Group, ops: AcceleratorOps, buffers: list[torch.Tensor], capacity: int,
                 *, copy_stream: Any, comm_stream: Any) -> None:
        self.slots = len(buffers)
        self.capacity = capacity
        self.packed: list[Any] = [ops.new_event() for _ in buffers]
        """Recorded on the copy stream once a slot is packed (``mark_packed``); the broadcast waits for it."""
        self._sent: list[Any | None] = [None] * len(buffers)
        self._group = group
        self._ops = ops
        self._buffers = buffers
        self._copy_stream = copy_stream
        self._comm_stream = comm_stream

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def mark_packed(self, slot: int) -> None:
        self._ops.record(self.packed[slot], self._copy_stream)

    def wait_slot(self, slot: int, deadline: float) -> None:
        """Device-side only: the copy stream will not overwrite ``slot`` before its last broadcast finished."""
        sent = self._sent[slot]
        if sent is not None:
            self._ops.stream_wait_event(self._copy_stream, sent)

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        ops = self._ops
        with ops.use(self._comm_stream):
            if slot != NO_SLOT:
                ops.stream_wait_event(self._comm_stream, self.packed[slot])
            # Small tensors made on the comm stream: the caching allocator reuses them only in that stream's order.
            control = torch.tensor([slot, nbytes, len(header)], dtype=torch.int64).to(ops.device)
            self._group.broadcast(control)
            self._group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(ops.device))
            if nbytes:
                self._group.broadcast(self._buffers[slot][:nbytes])
            done = ops.new_event()
            ops.record(done, self._comm_stream)
        if slot != NO_SLOT:
            self._sent[slot] = done
        else:
            # The end of an update (or its abort): send_weights returns only once every byte has left, so the
            # caller may modify its parameters (the optimizer step) right after.
            wait_event(ops, done, deadline, peer=self._group.peer, what="the last broadcast")

    def close(self) -> None:
        self._group.close()


class StreamedReceiver:
    """The collective receiver on device buckets: receives straight into the slot the consumer is not reading."""

    def __init__(self, group: Group, ops: AcceleratorOps, buffers: list[torch.Tensor], capacity: int,
                 *, comm_stream: Any) -> None:
        self.capacity = capacity
        self._group = group
        self._ops = ops
        self._buffers = buffers
        self._comm_stream = comm_stream
        self._consumed: list[Any | None] = [None] * len(buffers)
        self._free = FreeSlots(len(buffers))

    def receive(self, deadline: float) -> ReceivedBucket:
        slot = self._free.take(deadline)
        ops = self._ops
        try:
            with ops.use(self._comm_stream):
                consumed = self._consumed[slot]
                if consumed is not None:
                    ops.stream_wait_event(self._comm_stream, consumed)
                control = torch.zeros(3, dtype=torch.int64, device=ops.device)
                self._group.broadcast(control)
                sender_slot, nbytes, header_len = (int(v) for v in self._to_host(control, deadline).tolist())
                if not 0 <= nbytes <= self.capacity or not 0 <= header_len <= MAX_HEADER_BYTES:
                    raise TransferError(f"{self._group.peer} announced {nbytes} bytes / header {header_len}",
                                        peer=self._group.peer)
                header_tensor = torch.empty(header_len, dtype=torch.uint8, device=ops.device)
                self._group.broadcast(header_tensor)
                header_host = self._to_host(header_tensor, deadline)  # alive while its memory is read
                header = bytes(memoryview_of(header_host))
                if sender_slot == NO_SLOT or nbytes == 0:
                    self.release(slot + 1)
                    return ReceivedBucket(header=header, payload=self._buffers[slot][:0], token=0)
                payload = self._buffers[slot][:nbytes]
                self._group.broadcast(payload)
                arrived = ops.new_event()
                ops.record(arrived, self._comm_stream)
            # The consumer may read the views on any stream of its own, so the bytes must be there before they are
            # handed over; only this receive thread waits, on this one event.
            wait_event(ops, arrived, deadline, peer=self._group.peer, what="a bucket")
        except BaseException:
            self.release(slot + 1)
            raise
        return ReceivedBucket(header=header, payload=payload, token=slot + 1)

    def _to_host(self, tensor: torch.Tensor, deadline: float) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._ops.pinned)
        host.copy_(tensor, non_blocking=True)
        done = self._ops.new_event()
        self._ops.record(done, self._comm_stream)
        wait_event(self._ops, done, deadline, peer=self._group.peer, what="bucket metadata")
        return host

    def release(self, token: int) -> None:
        """Called on the consumer's thread: its copies out of the bucket were queued on its current stream."""
        if token <= 0:
            return
        slot = token - 1
        consumed = self._ops.new_event()
        self._ops.record(consumed, self._ops.current_stream())
        self._consumed[slot] = consumed
        self._free.give(slot)

    def close(self) -> None:
        self._group.close()


# -- topology ---------------------------------------------------------------------------------------------------------


def node_local_plan(*, actor_nodes: Sequence[str], rollout_nodes: Sequence[str]) -> dict[int, list[int]]:
    """Sender actor rank → the rollout ranks it serves, for ``relays="node"``.

    The sender of a node is its lowest actor rank; a rollout worker is served by the sender of its node, or by actor
    rank 0 when no actor rank shares its node. Senders without receivers are left out (they drain their stream). With
    no rollout workers at all, actor rank 0 is the only (idle) sender, so the topology still names one.
    """
    if not actor_nodes:
        raise TopologyError("node-local relays need at least one actor rank")
    first_on_node: dict[str, int] = {}
    for rank, node in enumerate(actor_nodes):
        first_on_node.setdefault(node, rank)
    plan: dict[int, list[int]] = {}
    for rollout_rank, node in enumerate(rollout_nodes):
        plan.setdefault(first_on_node.get(node, 0), []).append(rollout_rank)
    return dict(sorted(plan.items())) or {0: []}


# -- the transport ------------------------------------------------------------------------------------------------


class AcceleratorCollectiveTransport(GroupTransport):
    """The collective transport on device buckets. Backends supply ``device_type``, ``missing`` and ``new_group``.

    Options of its own: ``device_index`` (int; default: the calling process's current device) and ``relays``
    (``"none"``, the default, or ``"node"``; see the module docstring).
    """

    option_names: ClassVar[frozenset[str]] = frozenset({"device_index", "relays"})
    buffers: BufferPlace = "device"

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        options = settings.options
        relays = options.get("relays", "none")
        if relays not in RELAY_MODES:
            raise ConfigError(f"{self.name}: relays must be one of {', '.join(RELAY_MODES)}, got {relays!r}")
        device_index = options.get("device_index")
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int)
                                         or device_index < 0):
            raise ConfigError(f"{self.name}: device_index must be a non-negative int, got {device_index!r}")
        self.relays: Relays = relays
        self._ops = self.make_ops(device_index)
        self._policy = AcceleratorPolicy(self._ops, bucket_bytes=settings.bucket_bytes, timeout=settings.timeout)
        self._comm_stream = self._ops.new_stream()

    @classmethod
    def missing(cls) -> str | None:
        """What this process lacks to run the backend (its spec's probe reason), or None."""
        return None

    def make_ops(self, device_index: int | None) -> AcceleratorOps:
        """The device this engine moves buckets on: ``device_type``'s device ``device_index``, else the process's
        current one; ``BackendUnavailableError`` when ``missing()`` names what is missing or no such device is
        visible. A backend whose device torch has no module for overrides it."""
        reason = self.missing()
        if reason is not None:
            raise BackendUnavailableError(f"weightsync backend '{self.name}' cannot run here: {reason}",
                                          backend=self.name, reason=reason)
        module = torch.get_device_module(self.device_type)
        index = int(module.current_device()) if device_index is None else device_index
        if index >= int(module.device_count()):
            raise BackendUnavailableError(
                f"weightsync backend '{self.name}': device_index {index} but only {module.device_count()} "
                f"{self.device_type} devices are visible", backend=self.name, reason="device_index out of range")
        return AcceleratorOps(torch.device(self.device_type, index))

    @property
    def device(self) -> torch.device:
        return self._ops.device

    # -- prepare / topology --------------------------------------------------------------------------------------

    def policy(self) -> DevicePolicy:
        return self._policy

    def prepare(self) -> WorkerMetadata:
        metadata = super().prepare()
        if self.relays == "node" and self.settings.context.role == "actor" and self._store is None:
            # Any actor rank may become its node's sender, which serves its group from a store of its own.
            self._store = c10d.TCPStore(
                self.settings.context.host_ip, 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.settings.timeout),
            )
            metadata = {"store_host": self.settings.context.host_ip, "store_port": int(self._store.port)}
        return {**metadata, "relays": self.relays, "device": str(self._ops.device)}

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        workers = [decode_metadata(entry, GroupMetadata, who=f"{cls.name} worker {index}")
                   for index, entry in enumerate([*metadata.actor, *metadata.rollout])]
        modes = {worker.relays for worker in workers}
        if len(modes) > 1:
            raise TopologyError(f"{cls.name}: workers disagree on the relays option: {sorted(modes)}")
        mode = modes.pop() if modes else "none"
        if mode == "none":
            return super().build_topology(
                actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata
            )
        if len(metadata.actor) != actor_wg_world_size or len(metadata.rollout) != rollout_world_size:
            raise TopologyError(f"{cls.name}: metadata does not match actor_wg_world_size/rollout_world_size")
        actor_side = workers[:actor_wg_world_size]
        plan = node_local_plan(actor_nodes=[worker.node_id for worker in actor_side],
                               rollout_nodes=[worker.node_id for worker in workers[actor_wg_world_size:]])
        actor: list[RankPlan] = [Idle() for _ in range(actor_wg_world_size)]
        rollout: list[RankPlan] = [Idle() for _ in range(rollout_world_size)]
        for sender, receivers in plan.items():
            store = actor_side[sender]
            if not store.store_host or not store.store_port:
                raise TopologyError(f"{cls.name}: actor rank {sender} did not advertise a store (was prepare() "
                                    "called with relays='node' on every actor rank?)")
            host, port, size = store.store_host, store.store_port, 1 + len(receivers)
            actor[sender] = GroupSend(store_host=host, store_port=port, group_rank=0, group_size=size, sender=sender)
            for position, rollout_rank in enumerate(receivers):
                rollout[rollout_rank] = GroupReceive(store_host=host, store_port=port, group_rank=1 + position,
                                                     group_size=size, sender=sender)
        return Topology(actor=[encode_plan(args) for args in actor], rollout=[encode_plan(args) for args in rollout],
                        senders=tuple(plan))

    # -- connections ---------------------------------------------------------------------------------------------

    def ring(self) -> list[torch.Tensor]:
        if self._buffers is None:
            # Allocated once per engine on the copy stream and zeroed now: no update pays for the allocation.
            with self._ops.use(self._policy.copy_stream):
                self._buffers = [
                    torch.zeros(self.settings.bucket_bytes, dtype=torch.uint8, device=self._ops.device)
                    for _ in range(self.settings.slots)
                ]
        return self._buffers

    def connect_sender(self, plan: GroupSend) -> StreamedSender:
        return StreamedSender(self.join(plan), self._ops, self.ring(), self.settings.bucket_bytes,
                              copy_stream=self._policy.copy_stream, comm_stream=self._comm_stream)

    def connect_receiver(self, plan: GroupReceive) -> StreamedReceiver:
        return StreamedReceiver(self.join(plan), self._ops, self.ring(), self.settings.bucket_bytes,
                                comm_stream=self._comm_stream)

    def release(self) -> None:
        super().release()
        self._policy.staging = None
