"""What both collective transports share: a broadcast in a private process group of one membership epoch.

The group is built directly as ``ProcessGroup<Backend>(PrefixStore(epoch, TCPStore), rank, size, ...)``, never
through ``torch.distributed.init_process_group`` or ``new_group``: those go through the default group, which in a
trainer (FSDP) or an inference worker already exists and belongs to someone else. The ``TCPStore`` server lives
in a sender's engine for the engine's lifetime; each membership epoch gets a fresh prefix and group.

:class:`GroupTransport` holds the store, the topology (one group: actor rank 0 and every rollout worker) and the
joining of an epoch's group (:class:`Group`), and the typed plan its ranks are handed (:class:`GroupSend`,
:class:`GroupReceive`); its two families are siblings: the host one (:mod:`~weightsync.core.transports.collective.host`:
gloo on host buffers) and the device one (:mod:`~weightsync.core.transports.collective.device`: NCCL and HCCL on
device buffers, ordered by streams and events). Each supplies its ring, its group (``new_group``) and its sender and
receiver.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, ClassVar, Union

import torch
import torch.distributed as dist

from weightsync.api.errors import LifecycleError, TopologyError, TransferError
from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.transports.plan import Idle, RankPlan, RankRole, decode_metadata, encode_plan
from weightsync.core.transports.settings import EngineMetadata
from weightsync.core.transports.transport import Transport

__all__ = ["MAX_HEADER_BYTES", "Group", "GroupMember", "GroupMetadata", "GroupPlans", "GroupReceive", "GroupSend",
           "GroupTransport", "c10d", "gloo_group"]

# torch.distributed re-exports its C++ classes without declaring them to type checkers; every lookup goes through
# this alias at call time (so a test that wraps ``torch.distributed.ProcessGroupGloo`` sees every construction).
c10d: Any = dist

MAX_HEADER_BYTES = 64 << 20
"""The longest bucket header a receiver accepts (a bucket of very many tensors)."""


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
"""Every plan a rank of a collective transport may be handed."""


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


class GroupTransport(Transport):
    """A broadcast over a private process group of each epoch: the store, the topology, the joining; a family
    supplies ``device_type``, ``new_group``, its ring and its two ends."""

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
        """Build the epoch's group of ``size`` on ``store`` (a ``PrefixStore`` of the epoch), this rank ``rank``."""
        raise NotImplementedError(f"{type(self).__name__} supplies no process group")

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

    def release(self) -> None:
        self._buffers = None
        self._store = None


def gloo_group(store: Any, rank: int, size: int, *, timeout: float, host_ip: str) -> Any:
    """A gloo process group on ``store``, on the interface of ``host_ip``. Looked up on ``torch.distributed`` at call
    time (tests wrap the class)."""
    options = c10d.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [c10d.ProcessGroupGloo.create_device(hostname=host_ip)]
    return c10d.ProcessGroupGloo(store, rank, size, options)
