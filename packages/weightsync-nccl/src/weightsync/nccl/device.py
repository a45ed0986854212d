"""The accelerator instance of the collective engine, shared by NCCL (CUDA) and HCCL (Ascend).

What it adds to :class:`weightsync.gloo.CollectiveCheckpointEngine` (whose private ``PrefixStore(TCPStore)`` group,
epoch handling and three-broadcast wire protocol it reuses unchanged):

* **Device buckets.** Both rings (sender and receiver) live in device memory, allocated once per engine and touched
  at allocation. Receivers receive straight into them and yield views of them: no host bounce for the weights.
* **Two streams and events, never a device-wide sync.** Packing copies run on a *copy stream*, broadcasts on a
  *communication stream*. Per slot, a ``packed`` event (copy → comm: the broadcast may start) and a ``sent`` event
  (comm → copy: the slot may be overwritten) order them on the device, so packing bucket k+1 overlaps broadcasting
  bucket k. Receivers record a ``consumed`` event on the consumer's stream when it releases a bucket, and the next
  broadcast into that slot waits for it on the device. Host threads wait only on single events, by polling with a
  deadline (a hung peer becomes a ``TransferError``, not a frozen thread); ``torch.cuda.synchronize`` is never called.
* **Producer ordering.** The weights stream is produced on the caller's current stream (an FSDP all-gather, say);
  the copy stream waits for that stream before reading, and every source tensor is ``record_stream``'d on the copy
  stream so the caching allocator cannot hand its memory to the producer while a copy still reads it.
* **The end-to-end digest.** The pipeline hashes each bucket's bytes on the host (XXH3). A device bucket is staged
  into one pinned host buffer on a stream of its own, then hashed; this costs one device-to-host copy per bucket on
  each side (PCIe, overlapping the next broadcast) and is the price of verifying every update end to end.
* **Node-local senders** (option ``relays="node"``; default ``"none"``). With ``"none"`` actor rank 0 broadcasts to
  every rollout worker in one group (verl's design). With ``"node"`` the first actor rank of each node sends to the
  rollout workers of its own node, in a group per node, so the model crosses no inter-node link at all when actor
  and rollout share nodes (colocated / hybrid engine); rollout workers on nodes without an actor rank join actor
  rank 0's group. Every sender sends the *whole* model, so this needs every actor rank's weights stream to yield
  full tensors (true of verl's FSDP and Megatron per-tensor generators, which all-gather to every rank).

A CPU instance of this class (host ops, gloo group) runs the same code paths in the tests; device instances supply
:class:`AcceleratorOps` over ``torch.cuda`` or ``torch.npu`` and a group class.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, Literal

import torch

from weightsync.api.errors import ConfigError, TopologyError, TransferError
from weightsync.api.types import RankArgs, Topology, TransferReport, WorkerMetadata, WorldMetadata
from weightsync.core.digest import UpdateDigest
from weightsync.core.planner import PlannedBucket
from weightsync.core.tensors import memoryview_of
from weightsync.core.transport import NO_SLOT, ReceivedBucket, SenderTransport
from weightsync.gloo.collective import CollectiveCheckpointEngine, _Group, c10d

__all__ = [
    "RELAY_MODES",
    "Relays",
    "DeviceOps",
    "HostOps",
    "AcceleratorOps",
    "AcceleratorCollectiveEngine",
    "StreamedSender",
    "StreamedReceiver",
    "node_local_plan",
    "wait_event",
]

Relays = Literal["none", "node"]
RELAY_MODES: tuple[Relays, ...] = ("none", "node")

_MAX_HEADER_BYTES = 64 << 20


# -- device operations -----------------------------------------------------------------------------------------------


class DeviceOps(abc.ABC):
    """The handful of stream/event operations the engine uses, over one device.

    Kept this small so that CUDA, Ascend and the host (for tests) are three short implementations, and so that every
    synchronisation the engine does is visible here.
    """

    device: torch.device
    pinned: bool
    """Whether host staging buffers are page-locked (so device-to-host copies are truly asynchronous)."""

    @abc.abstractmethod
    def new_stream(self) -> Any: ...

    @abc.abstractmethod
    def new_event(self) -> Any: ...

    @abc.abstractmethod
    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Make ``stream`` the calling thread's current stream (and its device the current device)."""

    @abc.abstractmethod
    def current_stream(self) -> Any: ...

    @abc.abstractmethod
    def stream_wait_event(self, stream: Any, event: Any) -> None:
        """Device-side: work queued on ``stream`` from now on waits for ``event``. The host does not wait."""

    @abc.abstractmethod
    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        """Device-side: ``stream`` waits for everything queued on ``other`` so far."""

    @abc.abstractmethod
    def record(self, event: Any, stream: Any) -> None: ...

    @abc.abstractmethod
    def query(self, event: Any) -> bool:
        """Whether everything before ``event`` has finished (non-blocking)."""

    @abc.abstractmethod
    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator ``tensor`` is in use on ``stream`` (``Tensor.record_stream``)."""


class HostOps(DeviceOps):
    """CPU: every operation is synchronous, so streams and events are placeholders that are always complete."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.pinned = False

    def new_stream(self) -> Any:
        return None

    def new_event(self) -> Any:
        return None

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def current_stream(self) -> Any:
        return None

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        pass

    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def record(self, event: Any, stream: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return True

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        pass


class AcceleratorOps(DeviceOps):
    """``torch.cuda`` or ``torch.npu`` (torch_npu mirrors the CUDA stream/event API), on device ``index``."""

    def __init__(self, module: Any, device_type: str, index: int) -> None:
        self.module = module
        self.device = torch.device(device_type, index)
        self.pinned = True

    def new_stream(self) -> Any:
        return self.module.Stream(device=self.device)

    def new_event(self) -> Any:
        return self.module.Event()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        context: contextlib.AbstractContextManager[Any] = self.module.stream(stream)
        return context

    def current_stream(self) -> Any:
        return self.module.current_stream(self.device)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == self.device.type:
            tensor.record_stream(stream)


def wait_event(ops: DeviceOps, event: Any, deadline: float, *, peer: str, what: str) -> None:
    """Block the calling thread until ``event`` completes, or raise ``TransferError`` at ``deadline``.

    Polls ``query()`` with a sleep that grows from 50 µs to 2 ms instead of ``event.synchronize()``: a blocking
    synchronize cannot be given a deadline, and a peer that never joins the collective would freeze the thread.
    """
    pause = 50e-6
    while not ops.query(event):
        if time.monotonic() > deadline:
            raise TransferError(f"timed out waiting for {what} with {peer}", peer=peer)
        time.sleep(pause)
        pause = min(pause * 2, 2e-3)


# -- transports -------------------------------------------------------------------------------------------------------


class StreamedSender:
    """The collective sender on device buckets: broadcasts on the comm stream, ordered by per-slot events."""

    def __init__(self, group: _Group, ops: DeviceOps, buffers: list[torch.Tensor], capacity: int,
                 *, copy_stream: Any, comm_stream: Any) -> None:
        self.slots = len(buffers)
        self.capacity = capacity
        self.packed: list[Any] = [ops.new_event() for _ in buffers]
        """Recorded on the copy stream by the engine once a slot is packed; the broadcast waits for it."""
        self._sent: list[Any | None] = [None] * len(buffers)
        self._group = group
        self._ops = ops
        self._buffers = buffers
        self._copy_stream = copy_stream
        self._comm_stream = comm_stream

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

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

    def __init__(self, group: _Group, ops: DeviceOps, buffers: list[torch.Tensor], capacity: int,
                 *, comm_stream: Any) -> None:
        self.capacity = capacity
        self._group = group
        self._ops = ops
        self._buffers = buffers
        self._comm_stream = comm_stream
        self._consumed: list[Any | None] = [None] * len(buffers)
        self._free = list(range(len(buffers)))
        self._cond = threading.Condition()

    def receive(self, deadline: float) -> ReceivedBucket:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=max(deadline - time.monotonic(), 0)):
                raise TransferError("timed out waiting for the consumer to release a receive buffer",
                                    peer="local consumer")
            slot = self._free.pop(0)
        ops = self._ops
        try:
            with ops.use(self._comm_stream):
                consumed = self._consumed[slot]
                if consumed is not None:
                    ops.stream_wait_event(self._comm_stream, consumed)
                control = torch.zeros(3, dtype=torch.int64, device=ops.device)
                self._group.broadcast(control)
                sender_slot, nbytes, header_len = (int(v) for v in self._to_host(control, deadline).tolist())
                if not 0 <= nbytes <= self.capacity or not 0 <= header_len <= _MAX_HEADER_BYTES:
                    raise TransferError(f"{self._group.peer} announced {nbytes} bytes / header {header_len}",
                                        peer=self._group.peer)
                header_tensor = torch.empty(header_len, dtype=torch.uint8, device=ops.device)
                self._group.broadcast(header_tensor)
                header = bytes(memoryview_of(self._to_host(header_tensor, deadline)))
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
        with self._cond:
            self._consumed[slot] = consumed
            if slot not in self._free:
                self._free.append(slot)
                self._cond.notify()

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


# -- the engine -------------------------------------------------------------------------------------------------------


class _StagedDigest(UpdateDigest):
    """The pipeline's digest, fed device buckets: each payload is staged to host bytes first (whole buckets only)."""

    fusable = False

    def __init__(self, inner: UpdateDigest, stage: Any) -> None:
        # No super().__init__(): every call is delegated to ``inner``, which owns the hash state.
        self._inner = inner
        self._stage = stage

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self._inner.update_bucket(table, self._stage(payload))

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


class AcceleratorCollectiveEngine(CollectiveCheckpointEngine):
    """The collective engine on device buckets. Subclasses supply ``_make_ops`` (and ``_new_group``).

    Options of its own: ``device_index`` (int; default: the calling process's current device) and ``relays``
    (``"none"``, the default, or ``"node"``; see the module docstring).
    """

    name: ClassVar[str] = "accelerator"
    option_names: ClassVar[frozenset[str]] = frozenset({"device_index", "relays"})

    def __init__(self, *, bucket_bytes: int, **options: Any) -> None:
        relays = options.get("relays", "none")
        if relays not in RELAY_MODES:
            raise ConfigError(f"{self.name}: relays must be one of {', '.join(RELAY_MODES)}, got {relays!r}")
        device_index = options.get("device_index")
        if device_index is not None and (isinstance(device_index, bool) or not isinstance(device_index, int)
                                         or device_index < 0):
            raise ConfigError(f"{self.name}: device_index must be a non-negative int, got {device_index!r}")
        super().__init__(bucket_bytes=bucket_bytes, **options)
        self.relays: Relays = relays
        self._ops = self._make_ops(device_index)
        self._copy_stream = self._ops.new_stream()
        self._comm_stream = self._ops.new_stream()
        self._stage_stream = self._ops.new_stream()
        self._producer_stream: Any = None
        self._staging: torch.Tensor | None = None

    @abc.abstractmethod
    def _make_ops(self, device_index: int | None) -> DeviceOps:
        """The device this engine moves buckets on; raises ``BackendUnavailableError`` when there is none."""

    @property
    def device(self) -> torch.device:
        return self._ops.device

    # -- prepare / topology --------------------------------------------------------------------------------------

    def _prepare(self) -> WorkerMetadata:
        metadata = super()._prepare()
        if self.relays == "node" and self.context.role == "actor" and self._store is None:
            # Any actor rank may become its node's sender, which serves its group from a store of its own.
            self._store = c10d.TCPStore(
                self.context.host_ip, 0, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout),
            )
            metadata = {"store_host": self.context.host_ip, "store_port": int(self._store.port)}
        return {**metadata, "relays": self.relays, "device": str(self._ops.device)}

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        modes = {entry.get("relays", "none") for entry in [*metadata.actor, *metadata.rollout]}
        if len(modes) > 1:
            raise TopologyError(f"{cls.name}: workers disagree on the relays option: {sorted(map(str, modes))}")
        mode = modes.pop() if modes else "none"
        if mode == "none":
            return super().build_topology(
                actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata
            )
        if len(metadata.actor) != actor_wg_world_size or len(metadata.rollout) != rollout_world_size:
            raise TopologyError(f"{cls.name}: metadata does not match actor_wg_world_size/rollout_world_size")
        plan = node_local_plan(
            actor_nodes=[str(entry.get("node_id")) for entry in metadata.actor],
            rollout_nodes=[str(entry.get("node_id")) for entry in metadata.rollout],
        )
        actor: list[RankArgs] = [{"role": "idle"} for _ in range(actor_wg_world_size)]
        rollout: list[RankArgs] = [{} for _ in range(rollout_world_size)]
        for sender, receivers in plan.items():
            host, port = metadata.actor[sender].get("store_host"), metadata.actor[sender].get("store_port")
            if not isinstance(host, str) or not isinstance(port, int):
                raise TopologyError(f"{cls.name}: actor rank {sender} did not advertise a store (was prepare() "
                                    "called with relays='node' on every actor rank?)")
            common: RankArgs = {"store_host": host, "store_port": port, "group_size": 1 + len(receivers),
                                "sender": sender}
            actor[sender] = {**common, "role": "sender", "group_rank": 0}
            for position, rollout_rank in enumerate(receivers):
                rollout[rollout_rank] = {**common, "role": "receiver", "group_rank": 1 + position}
        return Topology(actor=actor, rollout=rollout, senders=tuple(plan))

    # -- connections ---------------------------------------------------------------------------------------------

    def _ring(self) -> list[torch.Tensor]:
        if self._buffers is None:
            # Allocated once per engine on the copy stream and zeroed now: no update pays for the allocation.
            with self._ops.use(self._copy_stream):
                self._buffers = [
                    torch.zeros(self.bucket_bytes, dtype=torch.uint8, device=self._ops.device)
                    for _ in range(self.slots)
                ]
        return self._buffers

    def _connect_sender(self, rank_args: RankArgs) -> StreamedSender:  # type: ignore[override]
        return StreamedSender(self._join(rank_args), self._ops, self._ring(), self.bucket_bytes,
                              copy_stream=self._copy_stream, comm_stream=self._comm_stream)

    def _connect_receiver(self, rank_args: RankArgs) -> StreamedReceiver:  # type: ignore[override]
        return StreamedReceiver(self._join(rank_args), self._ops, self._ring(), self.bucket_bytes,
                                comm_stream=self._comm_stream)

    def _release(self) -> None:
        super()._release()
        self._staging = None

    # -- the pipeline's device hooks -----------------------------------------------------------------------------

    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int = 0
    ) -> TransferReport:
        # The stream's tensors were produced on the caller's current stream; packing waits for it (device-side).
        self._producer_stream = self._ops.current_stream()
        try:
            return await super().send_weights(weights, version=version)
        finally:
            self._producer_stream = None

    def _pack(
        self, transport: SenderTransport, slot: int, index: int, bucket: PlannedBucket, version: int, epoch: str,
        digest: UpdateDigest, deadline: float,
    ) -> tuple[bytes, float]:
        ops = self._ops
        with ops.use(self._copy_stream):
            if self._producer_stream is not None:
                ops.stream_wait_stream(self._copy_stream, self._producer_stream)
            for _, source, _ in bucket.items:
                ops.keep_alive(source, self._copy_stream)
            result = super()._pack(
                transport, slot, index, bucket, version, epoch, digest, deadline
            )
            if isinstance(transport, StreamedSender):
                ops.record(transport.packed[slot], self._copy_stream)
        return result

    def _new_digest(self) -> UpdateDigest:
        """Device buckets are staged to host bytes before hashing (the pipeline builds every digest here)."""
        return _StagedDigest(UpdateDigest(), self._to_host)

    def _to_host(self, payload: torch.Tensor) -> torch.Tensor:
        """``payload``'s bytes on the host, for the digest: a pinned staging buffer reused for every bucket."""
        if payload.device.type == "cpu":
            return payload
        ops = self._ops
        if self._staging is None:
            self._staging = torch.empty(self.bucket_bytes, dtype=torch.uint8, pin_memory=ops.pinned)
        host = self._staging[: payload.numel()]
        current = ops.current_stream()
        with ops.use(self._stage_stream):
            # Called on the thread that produced the payload, inside its stream (the copy stream when packing; the
            # receive thread's stream after the bucket's arrival was awaited): wait for that stream only, so that
            # staging bucket k never waits for the broadcast of bucket k-1.
            ops.stream_wait_stream(self._stage_stream, current)
            ops.keep_alive(payload, self._stage_stream)
            host.copy_(payload, non_blocking=True)
            done = ops.new_event()
            ops.record(done, self._stage_stream)
        wait_event(ops, done, time.monotonic() + self.timeout, peer="local device", what="staging a bucket")
        return host

