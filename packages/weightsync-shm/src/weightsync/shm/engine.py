"""The ``shm`` engine: a ring of shared-memory buckets on one host.

The ring's buckets are core's ``SharedSegment``s (``/dev/shm`` files only their creator unlinks; see
``weightsync.core.transports.sharedmem``), which the chain's two-level layout shares within a host too.

Control: the sender listens on an abstract Unix socket; each receiver connects, presents the epoch token, and gets
the segment names. Per bucket the sender writes a frame ``slot, nbytes, header`` to every receiver; a receiver
acknowledges when its consumer is done with the bucket, and the sender overwrites a slot only once every receiver
has acknowledged what it last held. Frames from a connection that did not present the epoch token are never read.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any, ClassVar, Union

import msgspec
import torch

from weightsync.api.config import MiB
from weightsync.api.errors import LifecycleError, SharedMemoryFullError, TopologyError, TransferError, WireError
from weightsync.api.registry import KNOWN_BACKENDS, get_backend_spec, installed_backends
from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.backend import (
    NO_SLOT, WIRE_VERSION, Ack, AckedPeers, EngineMetadata, Hello, Idle, RankPlan, RankRole, ReceivedBucket,
    SharedSegment, SlotSequence, SourcesReceiver, Transport, accept_peers, decode_metadata, encode, encode_plan,
    engine_class, new_segment_prefix, plan_sources, recv_frame, send_frame, sweep_orphan_segments, too_small,
)

__all__ = ["ShmCheckpointEngine", "ShmTransport", "SharedSegment"]

_FRAME_PREFIX = 12  # int32 slot + int64 nbytes


class SegmentInfo(msgspec.Struct, frozen=True, tag="segments"):
    wire: int
    epoch: str
    names: list[str]
    capacity: int


_segment_decoder = msgspec.msgpack.Decoder(SegmentInfo)


class _Sender:
    """SenderTransport over the ring: frames out, acknowledgements in."""

    def __init__(self, segments: list[SharedSegment], peers: list[socket.socket], capacity: int, epoch: str) -> None:
        self.slots = len(segments)
        self.capacity = capacity
        self._segments = segments
        self._acks = AckedPeers([(f"rollout rank {rank}", sock) for rank, sock in enumerate(peers)], epoch)
        self._sequence = SlotSequence(self.slots)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._segments[slot].tensor

    def wait_slot(self, slot: int, deadline: float) -> None:
        self._acks.wait(self._sequence.last(slot), deadline)

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        frame = slot.to_bytes(4, "little", signed=True) + nbytes.to_bytes(8, "little") + header
        if slot != NO_SLOT:
            self._sequence.publish(slot)
        self._acks.send_all(frame, deadline)

    def close(self) -> None:
        self._acks.close()


class _Receiver:
    """ReceiverTransport: frames in, views of the sender's segments out, acknowledgements back."""

    def __init__(self, sock: socket.socket, segments: list[SharedSegment], capacity: int, epoch: str,
                 rank: int, timeout: float, peer: str) -> None:
        self.capacity = capacity
        self._sock, self._segments = sock, segments
        self._epoch, self._rank, self._timeout, self._peer = epoch, rank, timeout, peer
        self._received = 0

    def receive(self, deadline: float) -> ReceivedBucket:
        frame = recv_frame(self._sock, deadline=deadline, peer=self._peer)
        if len(frame) < _FRAME_PREFIX:
            raise WireError("short frame from the shm sender")
        slot = int.from_bytes(frame[:4], "little", signed=True)
        nbytes = int.from_bytes(frame[4:12], "little")
        if slot == NO_SLOT:
            return ReceivedBucket(header=frame[_FRAME_PREFIX:], payload=torch.empty(0, dtype=torch.uint8), token=0)
        if not 0 <= slot < len(self._segments) or nbytes > self.capacity:
            raise WireError(f"shm frame names slot {slot} with {nbytes} bytes, outside the ring")
        self._received += 1
        payload = self._segments[slot].tensor[:nbytes]
        return ReceivedBucket(header=frame[_FRAME_PREFIX:], payload=payload, token=self._received)

    def release(self, token: int) -> None:
        if token <= 0:
            return
        ack = Ack(wire=WIRE_VERSION, epoch=self._epoch, rank=self._rank, index=token)
        send_frame(self._sock, encode(ack), deadline=time.monotonic() + self._timeout, peer=self._peer)

    def close(self) -> None:
        self._sock.close()
        for segment in self._segments:
            segment.close()
        self._segments = []


class ShmMetadata(EngineMetadata, kw_only=True, frozen=True):
    """What an shm worker advertises: actor rank 0 its control socket's (abstract) address."""

    address: str = ""


class ShmSend(RankPlan, tag="shm-send", frozen=True):
    """The sender: how many receivers connect to it."""

    role: ClassVar[RankRole] = "sender"
    receivers: int = 0

    def __post_init__(self) -> None:
        if self.receivers < 0:
            raise ValueError(f"a receiver count is >= 0, got {self.receivers}")


class ShmReceive(RankPlan, tag="shm-receive", frozen=True):
    """A receiver: its rank and where the sender listens (a sharded ``actor_wg``'s: where each of its ``sources``
    listens, in the order of its ``streams``)."""

    role: ClassVar[RankRole] = "receiver"
    rank: int
    address: str = ""
    addresses: tuple[str, ...] = ()


class ShmTransport(Transport):
    """Shared-memory ring. Sender: actor rank 0; receivers: every rollout worker, all on the sender's host. A sharded
    ``actor_wg`` (``weightsync.api.sources``): every rank that holds bytes to send has a ring of its own, and every
    receiver reads all of them."""

    name: ClassVar[str] = "shm"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    # Four buckets: the sender packs ahead while the receivers, each at its own pace, consume the others (two made
    # it wait for the slower receiver at every bucket). The ring is one copy in /dev/shm for every receiver.
    default_slots: ClassVar[int] = 4
    plans: ClassVar[Any] = Union[Idle, ShmSend, ShmReceive]

    _listener: socket.socket | None = None
    _segments: list[SharedSegment] | None = None

    def prepare(self) -> WorkerMetadata:
        if self.settings.context.role != "actor":
            return {}
        if self._listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            # Abstract namespace: nothing on disk to clean up, gone when the socket closes.
            listener.bind(f"\0weightsync-shm-{os.getpid()}-{secrets.token_hex(6)}")
            listener.listen(128)
            self._listener = listener
        address = self._listener.getsockname()
        name = address.decode("latin-1") if isinstance(address, bytes) else str(address)
        return {"address": name.lstrip("\0")}

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        sources = plan_sources(metadata)
        ranks = sources.senders if sources is not None else (0,)
        actors = [decode_metadata(metadata.actor[rank], ShmMetadata, who=f"shm actor rank {rank}") for rank in ranks]
        sender = actors[0]
        for rank, actor_rank in zip(ranks, actors):
            if not actor_rank.address:
                raise TopologyError(f"shm: actor rank {rank} did not advertise a control address (was prepare() "
                                    "called?)")
            if actor_rank.node_id != sender.node_id:
                raise TopologyError(f"shm moves weights within one host, but actor ranks {ranks[0]} and {rank} of the "
                                    f"sharded actor_wg are on nodes {sender.node_id} and {actor_rank.node_id}")
        for rank, entry in enumerate(metadata.rollout):
            worker = decode_metadata(entry, ShmMetadata, who=f"shm rollout rank {rank}")
            if worker.node_id != sender.node_id:
                raise TopologyError(
                    f"shm moves weights within one host, but actor rank {ranks[0]} is on node {sender.node_id} and "
                    f"rollout rank {rank} is on node {worker.node_id}; use a backend that crosses nodes: "
                    f"{_cross_node_backends()}"
                )
        if sources is None:
            actor: list[RankPlan] = [ShmSend(receivers=rollout_world_size),
                                     *[Idle() for _ in range(actor_wg_world_size - 1)]]
            rollout = [ShmReceive(rank=rank, address=sender.address) for rank in range(rollout_world_size)]
        else:
            actor = [ShmSend(sender=rank, receivers=rollout_world_size, skip=sources.skip[rank])
                     if rank in sources.skip else Idle(sender=ranks[0]) for rank in range(actor_wg_world_size)]
            rollout = [ShmReceive(sender=ranks[0], rank=rank, streams=ranks,
                                  addresses=tuple(actor_rank.address for actor_rank in actors))
                       for rank in range(rollout_world_size)]
        return Topology(actor=[encode_plan(plan) for plan in actor], rollout=[encode_plan(plan) for plan in rollout],
                        senders=ranks, sharded=sources is not None)

    def connect_sender(self, plan: ShmSend) -> _Sender:
        receivers, epoch = plan.receivers, plan.epoch
        if self._listener is None:
            raise LifecycleError("shm: init_process_group before prepare on the sender")
        if self._segments is None:
            sweep_orphan_segments()
            prefix = new_segment_prefix()
            slots, size = self.settings.slots, self.settings.bucket_bytes
            what = f"the shm backend's ring ({slots} slots of {size / MiB:.1f} MiB)"
            segments: list[SharedSegment] = []
            try:
                for slot in range(slots):
                    segments.append(SharedSegment(f"{prefix}-{slot}", size, create=True, what=what))
            except BaseException as exc:
                for segment in segments:
                    segment.close()
                # The receivers are connecting to the listener meanwhile: closed, it fails them now (a reset
                # connection), not at their timeout; the next prepare opens another.
                self._listener.close()
                self._listener = None
                if isinstance(exc, SharedMemoryFullError):  # said of the whole ring, its segments given back
                    raise too_small(what, slots * size) from None
                raise
            self._segments = segments
        info = encode(SegmentInfo(
            wire=WIRE_VERSION, epoch=epoch, names=[s.name for s in self._segments], capacity=self.settings.bucket_bytes,
        ))
        peers = accept_peers(self._listener, ranks=range(receivers), epoch=epoch,
                             deadline=time.monotonic() + self.settings.timeout,
                             reply=lambda hello: info, what="shm sender")
        return _Sender(self._segments, peers, self.settings.bucket_bytes, epoch)

    def connect_receiver(self, plan: ShmReceive) -> _Receiver | SourcesReceiver:
        if not plan.streams:
            return self._connect(plan.address, plan.rank, plan.epoch, sender=0)
        if len(plan.addresses) != len(plan.streams):
            raise TopologyError(f"shm: a receiver of {len(plan.streams)} senders was given {len(plan.addresses)} "
                                "addresses", field="$.addresses")
        sources: list[_Receiver] = []
        try:
            for address, sender in zip(plan.addresses, plan.streams):
                sources.append(self._connect(address, plan.rank, plan.epoch, sender=sender))
        except BaseException:
            for source in sources:
                source.close()
            raise
        return SourcesReceiver(sources, plan.streams, epoch=plan.epoch)

    def _connect(self, address: str, rank: int, epoch: str, *, sender: int) -> _Receiver:
        deadline = time.monotonic() + self.settings.timeout
        peer = f"actor rank {sender} (shm sender)"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect("\0" + address)
            hello = Hello(wire=WIRE_VERSION, epoch=epoch, rank=rank)
            send_frame(sock, encode(hello), deadline=deadline, peer=peer)
            data = recv_frame(sock, deadline=deadline, peer=peer, max_len=1 << 16)
            try:
                info = _segment_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise WireError(f"malformed segment list from the shm sender: {exc}") from None
            if info.wire != WIRE_VERSION or info.epoch != epoch or info.capacity != self.settings.bucket_bytes:
                raise WireError("shm sender answered for another epoch or bucket size")
            segments = [SharedSegment(name, info.capacity, create=False) for name in info.names]
        except OSError as exc:
            sock.close()
            raise TransferError(f"shm receiver could not reach actor rank {sender}: {exc}",
                                peer=f"actor rank {sender}") from None
        except BaseException:
            sock.close()
            raise
        return _Receiver(sock, segments, info.capacity, epoch, rank, self.settings.timeout, peer)

    def release(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for segment in self._segments or []:
            segment.close()
        self._segments = None


ShmCheckpointEngine = engine_class(ShmTransport)

def _cross_node_backends() -> str:
    names = []
    for name in sorted(set(KNOWN_BACKENDS) | set(installed_backends())):
        if name in installed_backends():
            if get_backend_spec(name).cross_node:
                names.append(f"{name} (installed)")
        elif name in ("nixl", "mooncake", "nccl", "hccl"):
            names.append(f"{name} (pip install {KNOWN_BACKENDS[name]})")
    return ", ".join(names)
