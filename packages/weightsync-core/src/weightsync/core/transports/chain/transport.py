"""A pipelined chain (or tree) of one-sided reads: the transport and topology shared by ``nixl`` and ``mooncake``.

Why it lives in core: both backends move buckets the same way and differ only in the library that registers memory
and performs a one-sided read (:mod:`weightsync.core.transports.chain.rings`), so each backend adds only its ``make_ring``.

Topology
--------
Positions: 0 is the sender (actor rank 0, or a stripe's own), position p >= 1 is rollout rank p - 1. Option ``layout``:
``"chain"`` (default) reads in rank order — with fan-out degree d the upstream of position p is ``(p - 1) // d``:
d = 1 is the chain rank0 → r0 → r1 → … (the sender's egress is one model's bytes whatever the number of receivers),
larger d a d-ary tree (shorter, but each inner node serves d readers); ``"two_level"`` is host-aware: one leader per
host on that tree, the host's other workers reading its ring in place through shared memory (see
:mod:`weightsync.core.transports.chain.topology`). Fan-out and layout are engine options, read from actor rank 0's
metadata. With ``stripes`` (two-level only) the update is dealt over the hosts' rails, one chain per stripe, each with a
sender of its own (:mod:`weightsync.core.transports.chain.stripes`); listeners and rings bind to each worker's rail
address.

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

Control plane: one TCP connection per edge, opened by the downstream, framed with :mod:`weightsync.core.wire.framing`;
the downstream presents the epoch token (``Hello``) and receives the upstream's :class:`RingEndpoint` — plain
fields decoded by msgspec into a fixed schema; the library's transfer descriptors are rebuilt locally from them.
Nothing a peer sends is ever unpickled.
"""

from __future__ import annotations

import abc
import socket
import threading
import time
from typing import Any, ClassVar

import torch

from weightsync.api.errors import ConfigError, LifecycleError, TopologyError, TransferError
from weightsync.api.types import JsonValue, Topology, WorkerMetadata, WorldMetadata
from weightsync.core.wire import codec
from weightsync.core.transports.chain.ends import (
    MAX_CONTROL_FRAME,
    RELAY_PIECE_BYTES,
    ChainReceiver,
    ChainSender,
    Downstream,
    Upstream,
)
from weightsync.core.transports.chain.topology import LAYOUTS, chain_positions, plan_positions, position_name
from weightsync.core.transports.device import AcceleratorOps, AcceleratorPolicy, process_accelerator
from weightsync.core.transports.plan import Idle, decode_metadata, encode_plan
from weightsync.core.transports.chain.hostring import HostRingReader, map_upstream_ring
from weightsync.core.transports.chain.plan import (
    ChainMetadata,
    ChainPlans,
    ChainReceive,
    ChainSend,
    Source,
    StreamsReceive,
    StripesReceive,
)
from weightsync.core.transports.chain.rings import HOST_SHARED, BucketReady, RegisteredRing, RemoteRing, RingEndpoint, decode_ring
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.chain.groups import grouped_topology
from weightsync.core.transports.chain.sources import sharded_topology
from weightsync.core.transports.chain.stripes import OnRail, StripedReceiver, striped_topology
from weightsync.core.transports.sources import SourcesReceiver, plan_sources
from weightsync.core.transports.device import DevicePolicy, HOST_POLICY
from weightsync.core.transports.transport import Transport
from weightsync.core.wire.framing import accept_peers, recv_frame, send_frame

__all__ = [
    "DEFAULT_FANOUT", "BucketReady", "ChainTransport", "chain_positions", "RegisteredRing", "RemoteRing",
    "RingEndpoint",
]

DEFAULT_FANOUT = 1
"""Chain: the sender's egress stays one model whatever the number of receivers (docs/performance.md compares the
fan-outs)."""


# -- the transport ------------------------------------------------------------------------------------------------


class ChainTransport(Transport):
    """The one-sided chain. Options: ``fanout`` (readers per position, 1 = chain, the default), ``device``
    (``"cpu"``, or ``"cuda"`` for a ring in GPU memory where the library supports it), ``layout`` (``"chain"``, the
    default, or ``"two_level"``: one reader per host over the network, the host's others in place; host rings only),
    ``relay_piece_bytes`` (a relay forwards a bucket in pieces of this size as they land; default 1 MiB), ``stripes``
    (:mod:`.stripes`), ``left_out`` (rails > 0 no part group's stream goes over, :mod:`.groups`; ``auto`` sets it).

    A backend provides ``library`` and ``make_ring``. Sender: actor rank 0; every other actor rank drains its stream
    (a sharded ``actor_wg``, two-level: every rank that holds shards sends them, over a chain of its own:
    :mod:`weightsync.core.transports.chain.sources`).
    """

    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    option_names: ClassVar[frozenset[str]] = frozenset({"fanout", "device", "layout", "relay_piece_bytes",
                                                        "stripes", "left_out"})
    library: ClassVar[str]
    plans: ClassVar[Any] = ChainPlans

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
        stripes = settings.options.get("stripes", 1)
        if not _stripes_option(stripes):
            raise ConfigError(f"{self.name}: stripes must be an int >= 1 (at most that many), 'rails' (as many as the "
                              f"rails allow) or a list of distinct rails including 0 (over those), got {stripes!r}")
        if stripes != 1 and layout != "two_level":
            raise ConfigError(f"{self.name}: stripes need layout='two_level' (a stripe's leaders are per host)")
        if stripes != 1 and settings.delta:
            raise ConfigError(f"{self.name}: stripes and delta=True do not combine: a delta update (a few percent of "
                              "the model) travels as one stream; leave stripes out (backend='auto' stripes only "
                              "updates without delta)")
        left_out = settings.options.get("left_out", [])
        if not isinstance(left_out, list) or not all(
                isinstance(rail, int) and not isinstance(rail, bool) and rail > 0 for rail in left_out):
            raise ConfigError(f"{self.name}: left_out must be a list of rails > 0 (rail 0 carries the control "
                              f"plane), got {left_out!r}")
        piece = settings.options.get("relay_piece_bytes", RELAY_PIECE_BYTES)
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 4096:
            raise ConfigError(f"{self.name}: relay_piece_bytes must be an int >= 4096, got {piece!r}")
        self.fanout: int = fanout
        self.layout: str = layout
        self.stripes: JsonValue = stripes
        self.left_out: list[int] = sorted(set(left_out))
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
        """Rollout workers and actor rank 0 serve; with stripes every actor rank may send one, and in the two-level
        layout a part group's stream (:mod:`weightsync.core.transports.chain.groups`)."""
        return (self.settings.context.role == "rollout" or self.settings.context.rank == 0 or self.stripes != 1
                or self.layout == "two_level")

    def prepare(self) -> WorkerMetadata:
        if not self._serves():
            return {}  # ChainMetadata's defaults: no endpoint
        if self._ring is None and self.layout == "chain":
            self._ring = self.make_ring()  # two-level: made at connect, by the positions that need one
        if self._listener is None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.settings.rail_address, 0))
            listener.listen(64)
            self._listener = listener
        host, port = self._listener.getsockname()[:2]
        return {"address": f"{host}:{port}", "fanout": self.fanout, "layout": self.layout, "library": self.library,
                "stripes": self.stripes, "left_out": list[JsonValue](self.left_out)}

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
        workers = [decode_metadata(entry, ChainMetadata, who=f"{cls.name} {position_name(position)}")
                   for position, entry in enumerate([metadata.actor[0], *metadata.rollout])]
        for position, worker in enumerate(workers):
            if not worker.address or worker.library != cls.library:
                raise TopologyError(f"{cls.name}: {position_name(position)} did not advertise a {cls.library} "
                                    f"endpoint (was prepare() called with this backend?)")
        fanout, layout = workers[0].fanout, workers[0].layout
        if fanout < 1:
            raise TopologyError(f"{cls.name}: actor rank 0 advertised fanout {fanout!r}", field="$.fanout")
        if layout not in LAYOUTS:
            raise TopologyError(f"{cls.name}: actor rank 0 advertised layout {layout!r}", field="$.layout")
        addresses = [worker.address for worker in workers]
        sources = plan_sources(metadata)
        if sources is not None:  # every rank of a sharded actor_wg sends its shards, each over a chain of its own
            if layout != "two_level":
                raise TopologyError(f"{cls.name}: a sharded actor_wg sends over layout='two_level' (a chain per "
                                    "sending rank, by host)", field="$.layout")
            return sharded_topology(cls.library, metadata, sources, fanout=fanout, addresses=addresses[1:])
        grouped = grouped_topology(cls.library, metadata, fanout=fanout, addresses=addresses[1:])
        if grouped is not None:  # a stream per part group (over rails of its own where there are stripes)
            return grouped
        striped = striped_topology(cls.library, metadata, fanout=fanout, addresses=addresses[1:])
        if striped is not None:
            return striped
        plan = plan_positions(nodes=[worker.node_id for worker in workers], fanout=fanout, layout=layout)

        def in_place(position: int) -> tuple[int, ...]:
            return tuple(child for child in plan.children[position] if plan.local[child])

        actor = [ChainSend(children=tuple(plan.children[0]), in_place=in_place(0))]
        rollout = [ChainReceive(rank=position - 1, source=Source(
            upstream=addresses[plan.upstream[position]], upstream_position=plan.upstream[position],
            local=plan.local[position], children=tuple(plan.children[position]), in_place=in_place(position)))
            for position in range(1, rollout_world_size + 1)]
        return Topology(actor=[encode_plan(args) for args in [*actor, *[Idle()] * (actor_wg_world_size - 1)]],
                        rollout=[encode_plan(args) for args in rollout], senders=(0,))

    # -- step 3 --------------------------------------------------------------------------------------------------------

    def _ready_ring(self) -> RegisteredRing:
        if self._listener is None:
            raise LifecycleError(f"{self.name}: init_process_group before prepare on {self.settings.self_name}")
        if self._ring is None:
            self._ring = self.make_ring()
        return self._ring

    def connect_sender(self, plan: ChainSend) -> ChainSender:
        ring = self._ready_ring()
        downstream = self._accept_children(ring, plan.children, plan.in_place, plan.epoch)
        return ChainSender(ring, downstream)

    def connect_receiver(self, plan: ChainReceive | StripesReceive | StreamsReceive
                         ) -> ChainReceiver | HostRingReader | StripedReceiver | OnRail | SourcesReceiver:
        if isinstance(plan, StripesReceive):
            opened, routes = self._connect_many(plan.sources, rank=plan.rank, epoch=plan.epoch, what="stripe")
            return StripedReceiver(opened, epoch=plan.epoch, routes=routes)
        if isinstance(plan, StreamsReceive):  # a sharded actor_wg: every sending rank's stream
            opened, routes = self._connect_many(plan.sources, rank=plan.rank, epoch=plan.epoch, what="stream")
            return SourcesReceiver(opened, plan.streams, epoch=plan.epoch, routes=routes)
        alone = self._connect_one(plan.source, rank=plan.rank, epoch=plan.epoch)
        if plan.stripe is not None:
            # A stager of one stripe (a staged striped update): its stripe's chain, failures named by its rail.
            return OnRail(alone, f"stripe {plan.stripe.index}", None if plan.source.local else _route(plan.source))
        if plan.source.route is not None and plan.source.route.rail > 0 and not plan.source.local:
            # A part group's stream over a rail of its own (chain.groups): a failure names the rail, which the
            # manager then leaves out until a probe reaches it (control.rails), as a striped update's.
            return OnRail(alone, "stream", _route(plan.source))
        return alone

    def _connect_one(self, source: Source, *, rank: int, epoch: str) -> ChainReceiver | HostRingReader:
        peer = source.peer or position_name(source.upstream_position)
        deadline = time.monotonic() + self.settings.timeout
        if source.local:
            return self._connect_in_place(source.upstream, peer=peer, rank=rank, epoch=epoch, deadline=deadline)
        ring = self._ready_ring()
        upstream = self._connect_upstream(ring, source.upstream, peer=peer, rank=rank, epoch=epoch,
                                          deadline=deadline)
        try:
            downstream = self._accept_children(ring, source.children, source.in_place, epoch)
        except BaseException:
            upstream.close()
            raise
        return ChainReceiver(ring=ring, upstream=upstream, downstream=downstream, epoch=epoch, rank=rank,
                             piece_bytes=self.relay_piece_bytes)

    def _connect_upstream(self, ring: RegisteredRing, address: str, *, peer: str, rank: int, epoch: str,
                          deadline: float) -> Upstream:
        """The connection to an upstream on another host: the hello, its ring's endpoint, the ring opened."""
        sock = _connect(address, deadline=deadline, peer=peer)
        remote: RemoteRing | None = None
        try:
            hello = codec.Hello(wire=codec.WIRE_VERSION, epoch=epoch, rank=rank + 1)
            send_frame(sock, codec.encode(hello), deadline=deadline, peer=peer)
            endpoint = decode_ring(recv_frame(sock, deadline=deadline, peer=peer, max_len=MAX_CONTROL_FRAME),
                                   epoch=epoch, library=self.library, peer=peer)
            remote = ring.open(endpoint, peer=peer)
        except BaseException:
            sock.close()
            if remote is not None:
                remote.close()
            raise
        return Upstream(sock, peer, remote, endpoint)

    def _connect_many(self, sources: tuple[Source, ...], *, rank: int, epoch: str, what: str
                      ) -> tuple[list[ChainReceiver | HostRingReader], list[tuple[int, list[str]] | None]]:
        """A receiver of several chains (a striped update's stripes, a sharded actor_wg's streams), and the route
        of each it reads over the network: every chain's source — over the network for the one it leads, in place
        from the host's leader for every other. Its children are accepted while it connects: two workers of a host
        each lead a chain the other reads in place, so each must answer the other's hello before its own
        connections are done."""
        deadline = time.monotonic() + self.settings.timeout
        leading = [stripe for stripe, source in enumerate(sources) if not source.local]
        if len(leading) > 1:
            raise TopologyError(f"{self.name}: rollout rank {rank} leads {what}s {leading}; a worker leads one",
                                field="$.sources")
        accepting = _Accepting(self, [sources[stripe] for stripe in leading], epoch)
        opened: list[ChainReceiver | HostRingReader] = []
        try:
            for stripe, source in enumerate(sources):
                peer = source.peer or f"{what} {stripe}'s upstream"
                if stripe not in leading:
                    opened.append(self._connect_in_place(source.upstream, peer=peer, rank=rank, epoch=epoch,
                                                         deadline=deadline))
                    continue
                ring = self._ready_ring()
                upstream = self._connect_upstream(ring, source.upstream, peer=peer, rank=rank, epoch=epoch,
                                                  deadline=deadline)
                try:
                    downstream = accepting.result(deadline)
                except BaseException:
                    upstream.close()
                    raise
                opened.append(ChainReceiver(ring=ring, upstream=upstream, downstream=downstream, epoch=epoch,
                                            rank=rank, piece_bytes=self.relay_piece_bytes))
        except BaseException:
            for receiver in opened:
                receiver.close()
            accepting.close()
            raise
        return opened, [_route(source) if stripe in leading else None for stripe, source in enumerate(sources)]

    def _connect_in_place(self, address: str, *, peer: str, rank: int, epoch: str, deadline: float
                          ) -> HostRingReader:
        """A worker on its upstream's host: the same hello, then the upstream's shared ring mapped, not opened."""
        sock = _connect(address, deadline=deadline, peer=peer)
        try:
            send_frame(sock, codec.encode(codec.Hello(wire=codec.WIRE_VERSION, epoch=epoch, rank=rank + 1)),
                       deadline=deadline, peer=peer)
            endpoint = decode_ring(recv_frame(sock, deadline=deadline, peer=peer, max_len=MAX_CONTROL_FRAME),
                                   epoch=epoch, library=self.library, peer=peer)
            ring = map_upstream_ring(endpoint, peer=peer, node=self.settings.context.node_id)
        except BaseException:
            sock.close()
            raise
        return HostRingReader(sock=sock, peer=peer, ring=ring, endpoint=endpoint, epoch=epoch, rank=rank,
                              timeout=self.settings.timeout)

    def _accept_children(self, ring: RegisteredRing, children: tuple[int, ...], in_place: tuple[int, ...],
                         epoch: str) -> Downstream:
        """Accept a connection from every child position; each must present this epoch's token and its position
        (``in_place``: those of them that read this ring in place)."""
        listener = self._listener
        if listener is None:
            raise LifecycleError(f"{self.name}: init_process_group before prepare on {self.settings.self_name}")
        positions = sorted(children)
        endpoint = codec.encode(ring.endpoint(epoch=epoch))
        socks = accept_peers(listener, ranks=positions, epoch=epoch, deadline=time.monotonic() + self.settings.timeout,
                             reply=lambda hello: endpoint, what=self.settings.self_name)
        for sock in socks:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reading_in_place = frozenset(position_name(p) for p in in_place)
        return Downstream([(position_name(p), sock) for p, sock in zip(positions, socks)], epoch,
                          in_place=reading_in_place)


class _Accepting:
    """A striped receiver's children (of the stripe it leads, if any), accepted on a thread of their own."""

    def __init__(self, transport: ChainTransport, leading: list[Source], epoch: str) -> None:
        self._downstream: Downstream | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if not leading:
            return
        source = leading[0]
        ring = transport._ready_ring()

        def accept() -> None:
            try:
                self._downstream = transport._accept_children(ring, source.children, source.in_place, epoch)
            except BaseException as exc:  # noqa: BLE001 - raised on the connecting thread (``result``)
                self._error = exc

        self._thread = threading.Thread(target=accept, name="ws-chain-accept", daemon=True)
        self._thread.start()

    def result(self, deadline: float) -> Downstream:
        if self._thread is not None:
            self._thread.join(max(deadline - time.monotonic(), 0.0) + 1.0)
        if self._error is not None:
            raise self._error
        if self._downstream is None:
            raise TopologyError("the stripe's children were not all accepted in time")
        return self._downstream

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(1.0)
        if self._downstream is not None:
            self._downstream.close()


def _stripes_option(stripes: object) -> bool:
    """Whether ``stripes`` is a valid option: an int >= 1, ``"rails"``, or distinct rails (ints >= 0) with 0."""
    if isinstance(stripes, list):
        return all(isinstance(rail, int) and not isinstance(rail, bool) and rail >= 0 for rail in stripes) and (
            0 in stripes and len(set(stripes)) == len(stripes))
    return stripes == "rails" or (isinstance(stripes, int) and not isinstance(stripes, bool) and stripes >= 1)


def _route(source: Source) -> tuple[int, list[str]] | None:
    """The rail a stripe is read over and the two hosts it crosses (``striped_topology``'s ``route``)."""
    return (source.route.rail, list(source.route.hosts)) if source.route is not None else None


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
