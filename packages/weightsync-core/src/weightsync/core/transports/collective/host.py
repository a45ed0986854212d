"""The collective transport: a broadcast from actor rank 0 to every rollout worker in a private process group.

The group is built directly as ``ProcessGroup<Backend>(PrefixStore(epoch, TCPStore), rank, size, ...)``, never
through ``torch.distributed.init_process_group`` or ``new_group``: those go through the default group, which in a
trainer (FSDP) or an inference worker already exists and belongs to someone else. The ``TCPStore`` server lives
in actor rank 0's engine for the engine's lifetime; each membership epoch gets a fresh prefix and group.

Backends supply the device and the group: ``gloo`` (CPU tensors, a gloo group) uses it as it is; the accelerator
form (:mod:`weightsync.core.transports.collective.device`, NCCL and HCCL) sets ``device_type`` and ``new_group``.

Per bucket, two broadcasts: a control block of ``CONTROL_BYTES`` (slot, nbytes, header length, and the header
itself when it fits, as it does up to about a thousand tensors), then the payload; a longer header takes one more
broadcast between the two. Receivers keep their own ring of ``slots`` buffers, so receiving bucket k+1 overlaps the
consumer unpacking bucket k.
"""

from __future__ import annotations

import datetime
import os
import socket
import struct
from typing import Any, ClassVar, Union

import torch
import torch.distributed as dist

from weightsync.api.errors import LifecycleError, TopologyError, TransferError
from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.transports.plan import Idle, RankPlan, RankRole, decode_metadata, encode_plan
from weightsync.core.transports.seam import NO_SLOT, ReceivedBucket
from weightsync.core.transports.settings import EngineMetadata
from weightsync.core.transports.transport import Transport
from weightsync.core.transports.waiting import FreeSlots
from weightsync.core.wire.tensors import memoryview_of

__all__ = ["CONTROL_BYTES", "MAX_HEADER_BYTES", "CollectiveTransport", "Group", "GroupMember", "GroupMetadata",
           "GroupPlans", "GroupReceive", "GroupSend", "c10d"]

# torch.distributed re-exports its C++ classes without declaring them to type checkers; every lookup goes through
# this alias at call time (so a test that wraps ``torch.distributed.ProcessGroupGloo`` sees every construction).
c10d: Any = dist


class GroupMetadata(EngineMetadata, kw_only=True, frozen=True):
    """What a collective worker advertises: the store a sender serves its group from (``store_port`` 0: none), and
    the device collective's ``relays`` mode and device."""

    store_host: str = ""
    store_port: int = 0
    relays: str = "none"
    device: str = ""


class GroupMember(RankPlan, frozen=True):
    """A member of one epoch's group: where its sender's store is, its rank in the group and the group's size."""

    store_host: str
    store_port: int
    group_rank: int
    group_size: int


class GroupSend(GroupMember, tag="group-send", frozen=True):
    role: ClassVar[RankRole] = "sender"


class GroupReceive(GroupMember, tag="group-receive", frozen=True):
    role: ClassVar[RankRole] = "receiver"


GroupPlans = Union[Idle, GroupSend, GroupReceive]


class Group:
    """A process group of one epoch plus the helpers the transports share."""

    def __init__(self, group: Any, device: torch.device, peer: str) -> None:
        self.group = group
        self.device = device
        self.peer = peer
        self.closed = False

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.closed:
            # An abandoned update: fail at once instead of starting a collective that waits out its timeout.
            raise TransferError(f"the group with {self.peer} was closed (the update was abandoned)", peer=self.peer)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        try:
            self.group.broadcast([tensor], options).wait()
        except RuntimeError as exc:
            raise TransferError(f"broadcast with {self.peer} failed: {exc}", peer=self.peer) from None

    def close(self) -> None:
        self.closed = True
        for method in ("shutdown", "abort"):
            function = getattr(self.group, method, None)
            if function is not None:
                try:
                    function()
                    break
                except RuntimeError:
                    continue


CONTROL_BYTES = 64 * 1024
_PREFIX = struct.Struct("<qqq")  # slot, nbytes, header length
_INLINE = CONTROL_BYTES - _PREFIX.size
MAX_HEADER_BYTES = 64 << 20


class _Sender:
    def __init__(self, group: Group, buffers: list[torch.Tensor], capacity: int) -> None:
        self.slots = len(buffers)
        self.capacity = capacity
        self._group = group
        self._buffers = buffers
        self._control = bytearray(CONTROL_BYTES)
        self._control_tensor = torch.frombuffer(self._control, dtype=torch.uint8)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def wait_slot(self, slot: int, deadline: float) -> None:
        """A broadcast returns once its buffer may be reused, so a published slot is free by construction."""

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        _PREFIX.pack_into(self._control, 0, slot, nbytes, len(header))
        inline = header[:_INLINE]
        self._control[_PREFIX.size:_PREFIX.size + len(inline)] = inline
        self._group.broadcast(self._control_tensor)
        if len(header) > _INLINE:
            self._group.broadcast(torch.frombuffer(bytearray(header[_INLINE:]), dtype=torch.uint8))
        if nbytes:
            self._group.broadcast(self._buffers[slot][:nbytes])

    def close(self) -> None:
        self._group.close()


class _Receiver:
    def __init__(self, group: Group, buffers: list[torch.Tensor], capacity: int) -> None:
        self.capacity = capacity
        self._group = group
        self._buffers = buffers
        self._free = FreeSlots(len(buffers))
        self._control = bytearray(CONTROL_BYTES)
        self._control_tensor = torch.frombuffer(self._control, dtype=torch.uint8)

    def receive(self, deadline: float) -> ReceivedBucket:
        slot = self._free.take(deadline)
        try:
            self._group.broadcast(self._control_tensor)
            sender_slot, nbytes, header_len = _PREFIX.unpack_from(self._control, 0)
            if not 0 <= nbytes <= self.capacity or not 0 <= header_len <= MAX_HEADER_BYTES:
                raise TransferError(f"{self._group.peer} announced {nbytes} bytes / header {header_len}",
                                    peer=self._group.peer)
            header = bytes(self._control[_PREFIX.size:_PREFIX.size + min(header_len, _INLINE)])
            if header_len > _INLINE:
                rest = torch.empty(header_len - _INLINE, dtype=torch.uint8)
                self._group.broadcast(rest)
                header += _to_bytes(rest)
            if sender_slot == NO_SLOT or nbytes == 0:
                self.release(slot + 1)
                return ReceivedBucket(header=header, payload=self._buffers[slot][:0], token=0)
            payload = self._buffers[slot][:nbytes]
            self._group.broadcast(payload)
        except BaseException:
            self.release(slot + 1)
            raise
        return ReceivedBucket(header=header, payload=payload, token=slot + 1)

    def release(self, token: int) -> None:
        if token > 0:
            self._free.give(token - 1)

    def close(self) -> None:
        self._group.close()


def _to_bytes(tensor: torch.Tensor) -> bytes:
    host = tensor.cpu().contiguous()  # held while its memory is read: the memoryview does not keep it alive
    return bytes(memoryview_of(host))


class CollectiveTransport(Transport):
    """Broadcast over a private process group: gloo on host buffers as it is; subclasses may choose the device
    (``device_type``) and the group (``new_group``)."""

    name: ClassVar[str] = "gloo"
    device_type: ClassVar[str] = "cpu"
    plans: ClassVar[Any] = GroupPlans

    _store: Any = None
    _buffers: list[torch.Tensor] | None = None

    def prepare(self) -> WorkerMetadata:
        if self.settings.context.role == "actor" and self.settings.context.rank == 0 and self._store is None:
            # The store serves every epoch of this engine. Left to itself TCPStore listens on every interface; we
            # bind the listening socket to the control plane's address ourselves and hand it over.
            family, _, _, _, address = socket.getaddrinfo(self.settings.context.host_ip, 0, type=socket.SOCK_STREAM)[0]
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.bind(address)
            listener.listen(128)
            port = listener.getsockname()[1]
            descriptor = listener.detach()  # the store owns it from here on and closes it with itself
            try:
                self._store = c10d.TCPStore(
                    self.settings.context.host_ip, port, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=self.settings.timeout), master_listen_fd=descriptor,
                )
            except BaseException:
                os.close(descriptor)
                raise
        if self._store is not None:
            return {"store_host": self.settings.context.host_ip, "store_port": int(self._store.port)}
        return {}

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        sender = decode_metadata(metadata.actor[0], GroupMetadata, who=f"{cls.name} actor rank 0")
        if not sender.store_host or not sender.store_port:
            raise TopologyError(f"{cls.name}: actor rank 0 did not advertise its store (was prepare() called?)")
        host, port, size = sender.store_host, sender.store_port, 1 + rollout_world_size
        actor: list[RankPlan] = [GroupSend(store_host=host, store_port=port, group_rank=0, group_size=size)]
        actor += [Idle() for _ in range(actor_wg_world_size - 1)]
        rollout = [GroupReceive(store_host=host, store_port=port, group_rank=1 + rank, group_size=size)
                   for rank in range(rollout_world_size)]
        return Topology(actor=[encode_plan(plan) for plan in actor], rollout=[encode_plan(plan) for plan in rollout],
                        senders=(0,))

    def new_group(self, store: Any, rank: int, size: int) -> Any:
        """Build the epoch's group. Looked up on ``torch.distributed`` at call time (tests wrap the class)."""
        options = c10d.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self.settings.timeout)
        options._devices = [c10d.ProcessGroupGloo.create_device(hostname=self.settings.context.host_ip)]
        return c10d.ProcessGroupGloo(store, rank, size, options)

    def join(self, plan: GroupMember) -> Group:
        host, port, rank, size = plan.store_host, plan.store_port, plan.group_rank, plan.group_size
        if rank == 0:
            if self._store is None:
                raise LifecycleError(f"{self.name}: init_process_group before prepare on the sender")
            store = self._store
        else:
            try:
                store = c10d.TCPStore(host, port, is_master=False,
                                      timeout=datetime.timedelta(seconds=self.settings.timeout))
            except (RuntimeError, OSError) as exc:
                raise TransferError(f"{self.name}: cannot reach actor rank 0's store at {host}:{port}: {exc}",
                                    peer="actor rank 0") from None
        prefixed = c10d.PrefixStore(f"weightsync/{plan.epoch}", store)
        peer = "rollout workers" if rank == 0 else "actor rank 0"
        try:
            group = self.new_group(prefixed, rank, size)
        except RuntimeError as exc:
            raise TransferError(f"{self.name}: joining the group failed: {exc}", peer=peer) from None
        return Group(group, torch.device(self.device_type), peer)

    def ring(self) -> list[torch.Tensor]:
        if self._buffers is None:
            # Allocated once per engine and touched now, so no update pays for first-touch page faults.
            self._buffers = [
                torch.zeros(self.settings.bucket_bytes, dtype=torch.uint8, device=self.device_type)
                for _ in range(self.settings.slots)
            ]
        return self._buffers

    def connect_sender(self, plan: GroupSend) -> _Sender:
        return _Sender(self.join(plan), self.ring(), self.settings.bucket_bytes)

    def connect_receiver(self, plan: GroupReceive) -> _Receiver:
        return _Receiver(self.join(plan), self.ring(), self.settings.bucket_bytes)

    def release(self) -> None:
        self._buffers = None
        self._store = None
