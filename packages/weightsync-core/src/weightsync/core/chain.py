"""A pipelined chain (or tree) of one-sided reads: the transport and topology shared by ``nixl`` and ``mooncake``.

Why it lives in core: both backends move buckets the same way and differ only in the library that registers memory
and performs a one-sided read (:mod:`weightsync.core.rings`), so each backend adds only its ``make_ring``.

Topology
--------
Positions: 0 is actor rank 0 (the only sender), position p >= 1 is rollout rank p - 1. Option ``layout``:
``"chain"`` (default) reads in rank order — with fan-out degree d the upstream of position p is ``(p - 1) // d``:
d = 1 is the chain rank0 → r0 → r1 → … (the sender's egress is one model's bytes whatever the number of receivers),
larger d a d-ary tree (shorter, but each inner node serves d readers); ``"two_level"`` is host-aware: one leader per
host on that tree, the host's other workers reading its ring in place through shared memory (see
:mod:`weightsync.core.chaintopology`). Fan-out and layout are engine options, read from actor rank 0's metadata.

Data path
---------
Every engine of a sender or receiver owns one *ring*: ``slots`` buckets in one buffer, registered with the library
once when the engine is prepared, reused by every update of every epoch, deregistered on ``close()``. Per bucket:

1. the upstream announces it on the control socket (:class:`BucketReady`: its slot, the byte count, the bucket
   header produced by the pipeline);
2. the reader waits until its own slot for that bucket is free (its consumer released what the slot last held and
   every downstream has finished reading it), then reads the bytes straight out of the upstream's slot (one-sided);
3. it acknowledges the read (``Ack``), which lets the upstream reuse its slot, announces the bucket from its own
   slot to its downstreams, and hands the bucket to its local consumer.

So a hop forwards bucket k (its downstream reads it) while it is already reading bucket k+1.

Control plane: one TCP connection per edge, opened by the downstream, framed with :mod:`weightsync.core.framing`;
the downstream presents the epoch token (``Hello``) and receives the upstream's :class:`RingEndpoint` — plain
fields decoded by msgspec into a fixed schema; the library's transfer descriptors are rebuilt locally from them.
Nothing a peer sends is ever unpickled.
"""

from __future__ import annotations

import abc
import socket
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from weightsync.api.errors import ConfigError, LifecycleError, TopologyError, TransferError, WeightsyncError, WireError
from weightsync.api.types import RankArgs, Topology, WorkerMetadata, WorldMetadata
from weightsync.core import codec
from weightsync.core.device import AcceleratorOps, AcceleratorPolicy, process_accelerator
from weightsync.core.framing import accept_peers, recv_frame, send_frame
from weightsync.core.chaintopology import LAYOUTS, chain_positions, plan_positions, position_name
from weightsync.core.hostring import HostRingReader, map_upstream_ring
from weightsync.core.rings import (
    HOST_SHARED,
    BucketReady,
    RegisteredRing,
    RemoteRing,
    RingEndpoint,
    decode_ready,
    decode_ring,
)
from weightsync.core.settings import EngineSettings
from weightsync.core.transport import HOST_POLICY, NO_SLOT, DevicePolicy, ReceivedBucket, Transport
from weightsync.core.waiting import AckedPeers, SlotSequence

__all__ = [
    "DEFAULT_FANOUT", "BucketReady", "ChainTransport", "chain_positions", "RegisteredRing", "RemoteRing",
    "RingEndpoint",
]

DEFAULT_FANOUT = 1
"""Chain: the sender's egress stays one model whatever the number of receivers (docs/performance.md compares the
fan-outs)."""

_MAX_CONTROL_FRAME = 1 << 20  # headers of buckets with many tensors stay far below this

RELAY_PIECE_BYTES = 1 << 20
"""A relay reads a bucket in pieces of this size and announces each downstream as it lands (cut-through): each hop
adds one piece's time to an update rather than one bucket's (1 MiB: 4 ms on a 2 Gb/s link)."""


# -- the control plane's two ends ------------------------------------------------------------------------------------


class _Downstream:
    """The connections to the positions that read from this one: announcements out, read acknowledgements in."""

    def __init__(self, children: list[tuple[str, socket.socket]], epoch: str) -> None:
        self.reads = AckedPeers(children, epoch)
        self.epoch = epoch

    def announce(self, *, seq: int, slot: int, nbytes: int, header: bytes, deadline: float,
                 available: int = -1) -> None:
        frame = codec.encode(BucketReady(wire=codec.WIRE_VERSION, epoch=self.epoch, seq=seq, slot=slot,
                                         nbytes=nbytes, header=header, available=available))
        self.reads.send_all(frame, deadline)

    def abort(self, message: str) -> None:
        """Best effort: tell children this position failed, so they stop now rather than at their deadline."""
        header = codec.encode(codec.BucketHeader(
            wire=codec.WIRE_VERSION, epoch=self.epoch, version=0, sender=0, index=0, slot=NO_SLOT, nbytes=0,
            tensors=[], abort=message[:500] or "aborted",
        ))
        try:
            self.announce(seq=0, slot=NO_SLOT, nbytes=0, header=header, deadline=time.monotonic() + 2.0)
        except WeightsyncError:
            pass

    def close(self) -> None:
        self.reads.close()


class _ChainSender:
    """``SenderTransport`` of position 0: pack into the local ring, announce, reuse a slot once children read it."""

    def __init__(self, ring: RegisteredRing, downstream: _Downstream) -> None:
        self.slots = ring.slots
        self.capacity = ring.slot_bytes
        self._ring = ring
        self._downstream = downstream
        self._sequence = SlotSequence(ring.slots)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._ring.slot(slot)

    def wait_slot(self, slot: int, deadline: float) -> None:
        self._downstream.reads.wait(self._sequence.last(slot), deadline)

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        # One-sided: children pull the bytes; wait_slot keeps the slot intact until they have.
        seq = self._sequence.publish(slot) if slot != NO_SLOT else 0
        self._downstream.announce(seq=seq, slot=slot, nbytes=nbytes, header=header, deadline=deadline)

    def close(self) -> None:
        self._downstream.close()


@dataclass
class _Upstream:
    """The position this one reads from: its control connection and its ring, opened for one-sided reads."""

    sock: socket.socket
    name: str
    remote: RemoteRing
    ring: RingEndpoint


class _ChainReceiver:
    """``ReceiverTransport`` of a rollout position: read from upstream into the local ring, forward, hand over."""

    def __init__(self, *, ring: RegisteredRing, upstream: _Upstream, downstream: _Downstream, epoch: str, rank: int,
                 piece_bytes: int = RELAY_PIECE_BYTES) -> None:
        self.capacity = ring.slot_bytes
        self._piece_bytes = piece_bytes
        self._ring, self._upstream, self._downstream = ring, upstream, downstream
        self._epoch, self._rank = epoch, rank
        self._received = self._released = 0
        self._sequence = SlotSequence(ring.slots)
        self._consumer = threading.Condition()

    def receive(self, deadline: float) -> ReceivedBucket:
        try:
            return self._receive(deadline)
        except BaseException as exc:
            self._downstream.abort(f"rollout rank {self._rank} failed to receive: {type(exc).__name__}: {exc}")
            raise

    def _receive(self, deadline: float) -> ReceivedBucket:
        ready = self._next(deadline)
        if ready.slot == NO_SLOT:
            # The final or abort marker: pass it down the chain, no payload to read.
            self._downstream.announce(seq=0, slot=NO_SLOT, nbytes=0, header=ready.header, deadline=deadline)
            return ReceivedBucket(header=ready.header, payload=torch.empty(0, dtype=torch.uint8), token=0)
        remote, peer = self._upstream.ring, self._upstream.name
        if ready.seq != self._received + 1:
            raise WireError(f"{peer} announced bucket {ready.seq} after {self._received}")
        if not 0 <= ready.slot < remote.slots or not 0 <= ready.nbytes <= min(remote.slot_bytes, self.capacity):
            raise WireError(f"{peer} announced {ready.nbytes} bytes in slot {ready.slot}, outside the rings")
        seq = self._received = ready.seq
        slot = (seq - 1) % self._ring.slots
        self._wait_consumer(self._sequence.last(slot), deadline)
        self._downstream.reads.wait(self._sequence.last(slot), deadline)
        ready = self._read(ready, slot, deadline)
        ack = codec.Ack(wire=codec.WIRE_VERSION, epoch=self._epoch, rank=self._rank, index=seq)
        send_frame(self._upstream.sock, codec.encode(ack), deadline=deadline, peer=peer)
        self._sequence.record(slot, seq)
        self._downstream.announce(seq=seq, slot=slot, nbytes=ready.nbytes, header=ready.header, deadline=deadline)
        return ReceivedBucket(header=ready.header, payload=self._ring.slot(slot)[:ready.nbytes], token=seq)

    def _next(self, deadline: float) -> BucketReady:
        upstream = self._upstream
        frame = recv_frame(upstream.sock, deadline=deadline, peer=upstream.name, max_len=_MAX_CONTROL_FRAME)
        return decode_ready(frame, epoch=self._epoch, peer=upstream.name)

    def _read(self, ready: BucketReady, slot: int, deadline: float) -> BucketReady:
        """Read bucket ``ready.seq`` into ``slot`` in pieces of at most ``relay_piece_bytes``, as the upstream makes
        them available, announcing each piece to this position's children as it lands; the complete announcement."""
        upstream, done = self._upstream, 0
        local, remote = slot * self._ring.slot_bytes, ready.slot * upstream.ring.slot_bytes
        relaying = len(self._downstream.reads.peers) > len(self._downstream.reads.lost)
        while True:
            while done < ready.readable:
                # A last hop reads what is there in one go; a relay in pieces its children can follow.
                piece = min(self._piece_bytes if relaying else ready.readable, ready.readable - done)
                upstream.remote.read(local_offset=local + done, remote_offset=remote + done, nbytes=piece,
                                     deadline=deadline)
                done += piece
                if relaying and done < ready.nbytes:
                    self._downstream.announce(seq=ready.seq, slot=slot, nbytes=ready.nbytes, header=b"",
                                              deadline=deadline, available=done)
            if ready.complete:
                return ready
            more = self._next(deadline)
            if (more.seq, more.slot, more.nbytes) != (ready.seq, ready.slot, ready.nbytes) or (
                    not more.complete and more.available <= ready.available):
                raise WireError(f"{upstream.name} announced bucket {more.seq} ({more.available} of {more.nbytes} "
                                f"bytes) while bucket {ready.seq} was arriving")
            ready = more

    def _wait_consumer(self, seq: int, deadline: float) -> None:
        with self._consumer:
            while self._released < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"rollout rank {self._rank}: the local consumer did not release bucket {seq} "
                                        f"in time", peer=f"rollout rank {self._rank} (local consumer)")
                self._consumer.wait(left)

    def release(self, token: int) -> None:
        if token <= 0:
            return
        with self._consumer:
            self._released = max(self._released, token)
            self._consumer.notify_all()

    def close(self) -> None:
        self._upstream.sock.close()
        self._downstream.close()
        self._upstream.remote.close()


# -- the transport ------------------------------------------------------------------------------------------------


class ChainTransport(Transport):
    """The one-sided chain. Options: ``fanout`` (readers per position, 1 = chain, the default), ``device``
    (``"cpu"``, or ``"cuda"`` for a ring in GPU memory where the library supports it), ``layout`` (``"chain"``, the
    default, or ``"two_level"``: one reader per host over the network, the host's others in place; host rings only),
    ``relay_piece_bytes`` (a relay forwards a bucket in pieces of this size as they land; default 1 MiB).

    A backend provides ``library`` and ``make_ring``. Sender: actor rank 0; every other actor rank drains its stream.
    """

    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    option_names: ClassVar[frozenset[str]] = frozenset({"fanout", "device", "layout", "relay_piece_bytes"})
    library: ClassVar[str]

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        fanout = settings.options.get("fanout", DEFAULT_FANOUT)
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
            raise ConfigError(f"{self.name}: fanout must be an int >= 1 (1 = chain), got {fanout!r}")
        device = settings.options.get("device", "cpu")
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"{self.name}: device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and getattr(process_accelerator(), "type", None) != "cuda":
            raise ConfigError(f"{self.name}: device='cuda' puts the ring in GPU memory, but this process has no CUDA "
                              "device (leave device='cpu': tensors on any device are staged through a host ring)")
        layout = settings.options.get("layout", "chain")
        if layout not in LAYOUTS:
            raise ConfigError(f"{self.name}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if layout == "two_level" and device != "cpu":
            raise ConfigError(f"{self.name}: layout='two_level' shares a host ring between the workers of a host; "
                              f"it needs device='cpu' (tensors on any device are staged through it)")
        piece = settings.options.get("relay_piece_bytes", RELAY_PIECE_BYTES)
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 4096:
            raise ConfigError(f"{self.name}: relay_piece_bytes must be an int >= 4096, got {piece!r}")
        self.fanout: int = fanout
        self.layout: str = layout
        self.relay_piece_bytes: int = piece
        # A two-level ring is a shared segment: the other workers of this host may read it in place.
        self.ring_device: str = HOST_SHARED if layout == "two_level" else device
        self.buffers = "host" if device == "cpu" else "device"
        # A device ring's packing copies and digests are ordered on device streams; a host ring needs nothing.
        self._policy: DevicePolicy = HOST_POLICY if device == "cpu" else AcceleratorPolicy(
            AcceleratorOps(torch.device(device)), bucket_bytes=settings.bucket_bytes, timeout=settings.timeout)
        self._ring: RegisteredRing | None = None
        self._listener: socket.socket | None = None

    @abc.abstractmethod
    def make_ring(self) -> RegisteredRing:
        """Allocate and register this engine's ring (called once per engine)."""

    def policy(self) -> DevicePolicy:
        return self._policy

    # -- step 1 --------------------------------------------------------------------------------------------------------

    def _serves(self) -> bool:
        return self.settings.context.role == "rollout" or self.settings.context.rank == 0

    def prepare(self) -> WorkerMetadata:
        if not self._serves():
            return {}
        if self._ring is None and self.layout == "chain":
            self._ring = self.make_ring()  # two-level: made at connect, by the positions that need one
        if self._listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.settings.context.host_ip, 0))
            listener.listen(64)
            self._listener = listener
        host, port = self._listener.getsockname()[:2]
        return {"address": f"{host}:{port}", "fanout": self.fanout, "layout": self.layout, "library": self.library}

    def release(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
            ring.free()

    # -- step 2 --------------------------------------------------------------------------------------------------------

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        if actor_wg_world_size < 1 or len(metadata.actor) != actor_wg_world_size:
            raise TopologyError(f"{cls.name}: metadata for {len(metadata.actor)} actor ranks, "
                                f"actor_wg_world_size is {actor_wg_world_size}")
        if len(metadata.rollout) != rollout_world_size:
            raise TopologyError(f"{cls.name}: metadata for {len(metadata.rollout)} rollout ranks, "
                                f"rollout_world_size is {rollout_world_size}")
        workers = [metadata.actor[0], *metadata.rollout]
        addresses: list[str] = []
        for position, worker in enumerate(workers):
            address = worker.get("address")
            if not isinstance(address, str) or worker.get("library") != cls.library:
                raise TopologyError(f"{cls.name}: {position_name(position)} did not advertise a {cls.library} "
                                    f"endpoint (was prepare() called with this backend?)")
            addresses.append(address)
        fanout, layout = workers[0].get("fanout", DEFAULT_FANOUT), workers[0].get("layout", "chain")
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
            raise TopologyError(f"{cls.name}: actor rank 0 advertised fanout {fanout!r}")
        if layout not in LAYOUTS:
            raise TopologyError(f"{cls.name}: actor rank 0 advertised layout {layout!r}")
        plan = plan_positions(nodes=[str(worker.get("node_id")) for worker in workers], fanout=fanout,
                              layout=str(layout))
        actor: list[RankArgs] = [{"role": "sender", "sender": 0, "children": list(plan.children[0])}]
        actor += [{"role": "idle", "sender": 0} for _ in range(actor_wg_world_size - 1)]
        rollout: list[RankArgs] = []
        for position in range(1, rollout_world_size + 1):
            upstream = plan.upstream[position]
            rollout.append({
                "role": "receiver", "sender": 0, "rank": position - 1, "upstream": addresses[upstream],
                "upstream_position": upstream, "children": list(plan.children[position]),
                "local": plan.local[position],
            })
        return Topology(actor=actor, rollout=rollout, senders=(0,))

    # -- step 3 --------------------------------------------------------------------------------------------------------

    def _ready_ring(self) -> RegisteredRing:
        if self._listener is None:
            raise LifecycleError(f"{self.name}: init_process_group before prepare on {self.settings.self_name}")
        if self._ring is None:
            self._ring = self.make_ring()
        return self._ring

    def connect_sender(self, rank_args: RankArgs) -> _ChainSender:
        ring = self._ready_ring()
        epoch = str(rank_args["epoch"])
        downstream = self._accept_children(ring, rank_args, epoch)
        return _ChainSender(ring, downstream)

    def connect_receiver(self, rank_args: RankArgs) -> _ChainReceiver | HostRingReader:
        epoch = str(rank_args["epoch"])
        address, rank, upstream_position = (rank_args.get("upstream"), rank_args.get("rank"),
                                            rank_args.get("upstream_position"))
        if not isinstance(address, str) or not isinstance(rank, int) or not isinstance(upstream_position, int):
            raise TopologyError(f"{self.name}: receiver rank_args need upstream, upstream_position and rank, "
                                f"got {rank_args}")
        peer = position_name(upstream_position)
        deadline = time.monotonic() + self.settings.timeout
        if rank_args.get("local") is True:
            return self._connect_in_place(address, peer=peer, rank=rank, epoch=epoch, deadline=deadline)
        ring = self._ready_ring()
        sock = _connect(address, deadline=deadline, peer=peer)
        remote: RemoteRing | None = None
        try:
            hello = codec.Hello(wire=codec.WIRE_VERSION, epoch=epoch, rank=rank + 1)
            send_frame(sock, codec.encode(hello), deadline=deadline, peer=peer)
            endpoint = decode_ring(recv_frame(sock, deadline=deadline, peer=peer, max_len=_MAX_CONTROL_FRAME),
                                   epoch=epoch, library=self.library, peer=peer)
            remote = ring.open(endpoint, peer=peer)
            downstream = self._accept_children(ring, rank_args, epoch)
        except BaseException:
            sock.close()
            if remote is not None:
                remote.close()
            raise
        return _ChainReceiver(ring=ring, upstream=_Upstream(sock, peer, remote, endpoint), downstream=downstream,
                              epoch=epoch, rank=rank, piece_bytes=self.relay_piece_bytes)

    def _connect_in_place(self, address: str, *, peer: str, rank: int, epoch: str, deadline: float
                          ) -> HostRingReader:
        """A worker on its upstream's host: the same hello, then the upstream's shared ring mapped, not opened."""
        sock = _connect(address, deadline=deadline, peer=peer)
        try:
            send_frame(sock, codec.encode(codec.Hello(wire=codec.WIRE_VERSION, epoch=epoch, rank=rank + 1)),
                       deadline=deadline, peer=peer)
            endpoint = decode_ring(recv_frame(sock, deadline=deadline, peer=peer, max_len=_MAX_CONTROL_FRAME),
                                   epoch=epoch, library=self.library, peer=peer)
            ring = map_upstream_ring(endpoint, peer=peer, node=self.settings.context.node_id)
        except BaseException:
            sock.close()
            raise
        return HostRingReader(sock=sock, peer=peer, ring=ring, endpoint=endpoint, epoch=epoch, rank=rank,
                              timeout=self.settings.timeout)

    def _accept_children(self, ring: RegisteredRing, rank_args: RankArgs, epoch: str) -> _Downstream:
        """Accept a connection from every child position; each must present this epoch's token and its position."""
        listener = self._listener
        expected = rank_args.get("children", [])
        if listener is None or not isinstance(expected, list) or not all(isinstance(p, int) for p in expected):
            raise TopologyError(f"{self.name}: bad children {expected!r} in rank_args")
        positions = sorted(p for p in expected if isinstance(p, int))
        endpoint = codec.encode(ring.endpoint(epoch=epoch))
        socks = accept_peers(listener, ranks=positions, epoch=epoch, deadline=time.monotonic() + self.settings.timeout,
                             reply=lambda hello: endpoint, what=self.settings.self_name)
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Downstream([(position_name(p), sock) for p, sock in zip(positions, socks)], epoch)


def _connect(address: str, *, deadline: float, peer: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TopologyError(f"malformed address {address!r} for {peer}")
    try:
        sock = socket.create_connection((host, int(port)), timeout=max(deadline - time.monotonic(), 0.001))
    except OSError as exc:
        raise TransferError(f"could not connect to {peer} at {address}: {exc}", peer=peer) from None
    sock.setblocking(True)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
