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
:mod:`weightsync.core.transports.chain.topology`). Fan-out and layout are engine options, read from actor rank 0's metadata.
With ``stripes`` (two-level only) the update is dealt over the hosts' rails, one chain per stripe, each with a
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
from collections.abc import Mapping
from typing import ClassVar

import torch

from weightsync.api.errors import ConfigError, LifecycleError, TopologyError, TransferError
from weightsync.api.types import JsonValue, RankArgs, Topology, WorkerMetadata, WorldMetadata
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
from weightsync.core.transports.chain.hostring import HostRingReader, map_upstream_ring
from weightsync.core.transports.chain.rings import HOST_SHARED, BucketReady, RegisteredRing, RemoteRing, RingEndpoint, decode_ring
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.chain.stripes import OneStripe, StripedReceiver, striped_topology
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
    ``relay_piece_bytes`` (a relay forwards a bucket in pieces of this size as they land; default 1 MiB).

    A backend provides ``library`` and ``make_ring``. Sender: actor rank 0; every other actor rank drains its stream.
    """

    devices: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda"})
    option_names: ClassVar[frozenset[str]] = frozenset({"fanout", "device", "layout", "relay_piece_bytes",
                                                        "stripes"})
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
        stripes = settings.options.get("stripes", 1)
        if not _stripes_option(stripes):
            raise ConfigError(f"{self.name}: stripes must be an int >= 1 (at most that many), 'rails' (as many as the "
                              f"rails allow) or a list of distinct rails including 0 (over those), got {stripes!r}")
        if stripes != 1 and layout != "two_level":
            raise ConfigError(f"{self.name}: stripes need layout='two_level' (a stripe's leaders are per host)")
        piece = settings.options.get("relay_piece_bytes", RELAY_PIECE_BYTES)
        if isinstance(piece, bool) or not isinstance(piece, int) or piece < 4096:
            raise ConfigError(f"{self.name}: relay_piece_bytes must be an int >= 4096, got {piece!r}")
        self.fanout: int = fanout
        self.layout: str = layout
        self.stripes: JsonValue = stripes
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
        """Rollout workers and actor rank 0 serve; with stripes every actor rank may send one."""
        return self.settings.context.role == "rollout" or self.settings.context.rank == 0 or self.stripes != 1

    def prepare(self) -> WorkerMetadata:
        if not self._serves():
            return {}
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
                "stripes": self.stripes}

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
        striped = striped_topology(cls.library, metadata, fanout=fanout, addresses=addresses[1:])
        if striped is not None:
            return striped
        plan = plan_positions(nodes=[str(worker.get("node_id")) for worker in workers], fanout=fanout,
                              layout=str(layout))
        def in_place(position: int) -> list[JsonValue]:
            return [child for child in plan.children[position] if plan.local[child]]

        actor: list[RankArgs] = [{"role": "sender", "sender": 0, "children": list(plan.children[0]),
                                  "in_place": in_place(0)}]
        actor += [{"role": "idle", "sender": 0} for _ in range(actor_wg_world_size - 1)]
        rollout: list[RankArgs] = []
        for position in range(1, rollout_world_size + 1):
            upstream = plan.upstream[position]
            rollout.append({
                "role": "receiver", "sender": 0, "rank": position - 1, "upstream": addresses[upstream],
                "upstream_position": upstream, "children": list(plan.children[position]),
                "in_place": in_place(position),
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

    def connect_sender(self, rank_args: RankArgs) -> ChainSender:
        ring = self._ready_ring()
        epoch = str(rank_args["epoch"])
        downstream = self._accept_children(ring, rank_args, epoch)
        return ChainSender(ring, downstream)

    def connect_receiver(self, rank_args: RankArgs) -> ChainReceiver | HostRingReader | StripedReceiver | OneStripe:
        if isinstance(rank_args.get("sources"), list):
            return self._connect_stripes(rank_args)
        stripe = rank_args.get("stripe")
        if isinstance(stripe, list) and stripe and isinstance(stripe[0], int):
            # A stager of one stripe (a staged striped update): its stripe's chain, failures named by its rail.
            alone = self._connect_one(rank_args)
            return OneStripe(alone, stripe[0], None if rank_args.get("local") is True else _route(rank_args))
        return self._connect_one(rank_args)

    def _connect_one(self, rank_args: RankArgs) -> ChainReceiver | HostRingReader:
        epoch = str(rank_args["epoch"])
        address, rank, upstream_position = (rank_args.get("upstream"), rank_args.get("rank"),
                                            rank_args.get("upstream_position"))
        if not isinstance(address, str) or not isinstance(rank, int) or not isinstance(upstream_position, int):
            raise TopologyError(f"{self.name}: receiver rank_args need upstream, upstream_position and rank, "
                                f"got {rank_args}")
        peer = str(rank_args.get("peer") or position_name(upstream_position))
        deadline = time.monotonic() + self.settings.timeout
        if rank_args.get("local") is True:
            return self._connect_in_place(address, peer=peer, rank=rank, epoch=epoch, deadline=deadline)
        ring = self._ready_ring()
        upstream = self._connect_upstream(ring, address, peer=peer, rank=rank, epoch=epoch, deadline=deadline)
        try:
            downstream = self._accept_children(ring, rank_args, epoch)
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

    def _connect_stripes(self, rank_args: RankArgs) -> StripedReceiver:
        """A receiver of a striped update: every stripe's source (``rank_args["sources"]``, one per stripe) — over
        the network for the stripe it leads (its rail's), in place from the host's leader for every other. Its
        children are accepted while it connects: two workers of a host each lead a stripe the other reads in place,
        so each must answer the other's hello before its own connections are done."""
        epoch, rank, listed = str(rank_args["epoch"]), rank_args.get("rank"), rank_args.get("sources")
        listed = listed if isinstance(listed, list) else []
        sources = [source for source in listed if isinstance(source, dict)]
        if not isinstance(rank, int) or not sources or len(sources) != len(listed):
            raise TopologyError(f"{self.name}: striped receiver rank_args need rank and sources, got {rank_args}")
        deadline = time.monotonic() + self.settings.timeout
        leading = [stripe for stripe, source in enumerate(sources) if source.get("local") is not True]
        if len(leading) > 1:
            raise TopologyError(f"{self.name}: rollout rank {rank} leads stripes {leading}; a worker leads one")
        accepting = _Accepting(self, leading, sources, epoch)
        opened: list[ChainReceiver | HostRingReader] = []
        try:
            for stripe, source in enumerate(sources):
                address, upstream_position, peer = (source.get("upstream"), source.get("upstream_position"),
                                                    str(source.get("peer", f"stripe {stripe}'s upstream")))
                if not isinstance(address, str) or not isinstance(upstream_position, int):
                    raise TopologyError(f"{self.name}: stripe {stripe}'s source needs upstream and upstream_position")
                if stripe not in leading:
                    opened.append(self._connect_in_place(address, peer=peer, rank=rank, epoch=epoch,
                                                         deadline=deadline))
                    continue
                ring = self._ready_ring()
                upstream = self._connect_upstream(ring, address, peer=peer, rank=rank, epoch=epoch, deadline=deadline)
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
        return StripedReceiver(opened, epoch=epoch, routes=[_route(source) if stripe in leading else None
                                                            for stripe, source in enumerate(sources)])

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

    def _accept_children(self, ring: RegisteredRing, rank_args: RankArgs, epoch: str) -> Downstream:
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
        listed = rank_args.get("in_place", [])
        in_place = frozenset(position_name(p) for p in (listed if isinstance(listed, list) else [])
                             if isinstance(p, int))
        return Downstream([(position_name(p), sock) for p, sock in zip(positions, socks)], epoch, in_place=in_place)


class _Accepting:
    """A striped receiver's children (of the stripe it leads, if any), accepted on a thread of their own."""

    def __init__(self, transport: ChainTransport, leading: list[int], sources: list[dict[str, JsonValue]],
                 epoch: str) -> None:
        self._downstream: Downstream | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if not leading:
            return
        args: RankArgs = dict(sources[leading[0]])
        ring = transport._ready_ring()

        def accept() -> None:
            try:
                self._downstream = transport._accept_children(ring, args, epoch)
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


def _route(source: Mapping[str, JsonValue]) -> tuple[int, list[str]] | None:
    """The rail a stripe is read over and the two hosts it crosses (``striped_topology``'s ``rail`` and
    ``hosts``)."""
    rail, ends = source.get("rail"), source.get("hosts")
    if not isinstance(rail, int) or not isinstance(ends, list) or len(ends) != 2:
        return None
    return rail, [str(host) for host in ends]


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
