"""Stripes: an update's buckets dealt over K senders, each on a rail of its own, and read back in bucket order.

Bucket i of an update belongs to stripe i mod K. Stripe s goes over a rail of its own (the s-th of
:func:`stripes_for`'s, rail s unless a rail is left out), sent by a sender of its own (the actor rank on that rail
of the sender's host) that packs, hashes and publishes only its stripe's buckets, then a final header of its own:
its stripe's digest, and the update's bucket count N. A receiver reads the stripes from K sources (its own stripe
over its rail, the host's other stripes in place from the workers that lead them) through :class:`StripedReceiver`,
which hands the pipeline one stream: every bucket in bucket order, then one final header whose digest combines
the stripes' (:func:`~weightsync.core.wire.digest.combine_stripes`), which the receiver's
:class:`~weightsync.core.wire.digest.StripedDigest` computes from the bytes it read, and whose part sums are the
stripes' one after another: a worker that declared its part reads and verifies only that, stripe by stripe
(:class:`~weightsync.core.wire.sources.StripesSums`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from weightsync.api.errors import TopologyError, TransferError, WireError
from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.transports.chain.plan import (
    ChainMetadata,
    ChainReceive,
    ChainSend,
    Route,
    Source,
    Stripe,
    StripesReceive,
)
from weightsync.core.transports.chain.topology import plan_stripe, stripe_rails
from weightsync.core.transports.plan import Idle, RankPlan, decode_metadata, encode_plan
from weightsync.core.transports.seam import ReceivedBucket, ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.digest import combine_stripes
from weightsync.core.wire.partplans import PartPlan

__all__ = ["Dealt", "Interleaved", "OnRail", "ReadAhead", "StripedReceiver", "chain_metadata", "deal", "on_rail",
           "stripe_of", "stripe_senders", "stripes_for", "striped_topology"]


def stripe_of(index: int, stripes: int) -> int:
    """The stripe bucket ``index`` belongs to."""
    return index % stripes


class Interleaved:
    """What a receiver over several sources shares (a striped update's stripes; a sharded ``actor_wg``'s streams,
    ``weightsync.core.transports.sources.SourcesReceiver``): a bucket of source i with token t is handed out as
    ``(t - 1) * K + i + 1`` (positive, and unique while held, as each source's are) and released to source i as t,
    so each source sees its releases in its own order (the transport rules); ``close`` closes every source, then
    waits for the reading threads (``_ahead``, one per source where the sources are read ahead)."""

    _sources: list[ReceiverTransport]
    _ahead: list[ReadAhead]

    def _handed(self, received: ReceivedBucket, index: int) -> ReceivedBucket:
        """``received``, a bucket of source ``index``, with the token it is handed out under."""
        return ReceivedBucket(received.header, received.payload, (received.token - 1) * len(self._sources) + index + 1)

    def release(self, token: int) -> None:
        if token == 0:
            return
        count = len(self._sources)
        self._sources[(token - 1) % count].release((token - 1) // count + 1)

    def close(self) -> None:
        for source in self._sources:
            source.close()  # a reading thread blocked in it fails now, and ends
        for ahead in self._ahead:
            ahead.join(5.0)


class StripedReceiver(Interleaved):
    """One ``ReceiverTransport`` over K stripe sources (``sources[s]`` yields stripe s's buckets in order, then its
    final header or an abort): bucket i is taken from source i mod K.

    Every source is read by a thread of its own (:class:`ReadAhead`), from an update's first ``receive`` to its
    marker: a chain source pulls its bytes inside ``receive``, so the stripes move at once, each over its rail, as
    far ahead as its ring's slots allow (a slot comes back when the consumer releases it).

    Tokens as :class:`Interleaved` hands them out. An abort from any source is handed on as it is. A final header ends
    the update only when every source has sent one: all must name the same bucket count N, equal to the buckets read,
    and the header handed on carries the combined digest and N."""

    def __init__(self, sources: Sequence[ReceiverTransport], *, epoch: str,
                 routes: Sequence[tuple[int, list[str]] | None] | None = None) -> None:
        """``routes[s]``: stripe s's rail and the two hosts it crosses when read over the network (None in place):
        a failure reading it is then a ``TransferError`` naming them (``rail``, ``hosts``)."""
        if not sources:
            raise ValueError("a striped receiver needs at least one source")
        self._sources = list(sources)
        ways = list(routes) if routes is not None else [None] * len(self._sources)
        self._ahead = [ReadAhead(source, f"stripe {stripe}", ways[stripe])
                       for stripe, source in enumerate(self._sources)]
        self._epoch = epoch
        self.capacity = max(source.capacity for source in self._sources)
        self._next = 0
        """Index of the next bucket of the update under way: it comes from source ``_next mod K``."""

    def receive(self, deadline: float) -> ReceivedBucket:
        stripes = len(self._sources)
        if self._next == 0:
            for ahead in self._ahead:
                ahead.start(deadline)
        stripe = stripe_of(self._next, stripes)
        received = self._ahead[stripe].get(deadline)
        if received.token != 0:
            self._next += 1
            return self._handed(received, stripe)
        header = self._decode(received.header)
        if header.abort or not header.final:
            return received
        finals = {stripe: header}
        for other in range(stripes):
            if other == stripe:
                continue
            marker = self._ahead[other].get(deadline)
            if marker.token != 0:
                raise WireError(f"stripe {other} sent a bucket after stripe {stripe} ended the update at bucket "
                                f"{self._next}")
            decoded = self._decode(marker.header)
            if decoded.abort or not decoded.final:
                return marker
            finals[other] = decoded
        counts = {final.index for final in finals.values()}
        arrived, self._next = self._next, 0  # the next update starts at bucket 0, from stripe 0
        if counts != {arrived}:
            raise WireError(f"the stripes' final headers name {sorted(counts)} buckets, {arrived} arrived")
        if len({len(final.parts) for final in finals.values()}) != 1:
            raise WireError(f"the stripes' final headers carry the sums of "
                            f"{[len(finals[s].parts) for s in range(stripes)]} parts")
        combined = combine_stripes([finals[s].digest for s in range(stripes)])
        parts = [b"".join(finals[s].parts[at] for s in range(stripes)) for at in range(len(finals[0].parts))]
        return ReceivedBucket(codec.encode(msgspec.structs.replace(finals[0], digest=combined, parts=parts)),
                              received.payload[:0], 0)

    def _decode(self, header: bytes) -> codec.BucketHeader:
        decoded, _ = codec.decode_bucket(header, epoch=self._epoch, capacity=self.capacity)
        return decoded


class ReadAhead:
    """One stripe's (or one sender's stream's) reading thread for one update: ``receive`` on its source until the
    marker, into a queue, as far ahead as the source's ring allows."""

    def __init__(self, source: ReceiverTransport, what: str, route: tuple[int, list[str]] | None, *,
                 into: tuple[queue.SimpleQueue[tuple[int, ReceivedBucket | BaseException]], int] | None = None
                 ) -> None:
        """``what``: how errors name the source (``stripe 1``); ``route``: its rail and hosts when read over one;
        ``into``: a queue several sources share, and this one's index there (what it reads goes there, tagged, for a
        consumer that takes whichever source delivers first; ``get`` is then not used)."""
        self._source, self._what, self._route = source, what, route
        self._queue: queue.SimpleQueue[ReceivedBucket | BaseException] = queue.SimpleQueue()
        self._put: Callable[[ReceivedBucket | BaseException], None] = self._queue.put
        if into is not None:
            shared, index = into
            self._put = lambda item: shared.put((index, item))
        self._thread: threading.Thread | None = None

    def start(self, deadline: float) -> None:
        if self._thread is not None:  # the last update's reader ends at its marker, which the pipeline reads
            self._thread.join(max(deadline - time.monotonic(), 0.0))
            if self._thread.is_alive():
                raise TransferError(f"{self._what} is still reading the last update", peer=self._what)
        self._thread = threading.Thread(target=self._read, args=(deadline,), daemon=True,
                                        name=f"ws-{self._what.replace(' ', '-')}")
        self._thread.start()

    def _read(self, deadline: float) -> None:
        try:
            while True:
                received = self._source.receive(deadline)
                self._put(received)
                if received.token == 0:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's receive, which raises it
            self._put(on_rail(exc, self._what, self._route))

    def get(self, deadline: float) -> ReceivedBucket:
        try:
            item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
        except queue.Empty:
            raise TransferError(f"{self._what} delivered nothing before the deadline", peer=self._what) from None
        if isinstance(item, BaseException):
            raise item
        return item

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)


def on_rail(error: BaseException, what: str, route: tuple[int, list[str]] | None) -> BaseException:
    """A failure reading ``what`` (``stripe 1``) over the network (``route``: its rail and the two hosts it crosses),
    as a ``TransferError`` naming them (``rail``, ``hosts``); read in place (no route), the error as it is."""
    if route is None or not isinstance(error, Exception):
        return error
    rail, hosts = route
    named = TransferError(f"{what} over rail {rail} from host {hosts[0]} to host {hosts[1]} failed: {error}",
                          peer=str(getattr(error, "peer", what)),
                          closed=bool(getattr(error, "closed", False)), rail=rail, hosts=list(hosts))
    named.__cause__ = error
    return named


class OnRail:
    """A receiver of one chain read over a rail, its failures named as :class:`StripedReceiver` names a stripe's
    (``what``: ``stripe 1``, ``stream``; ``route``: its rail and hosts, None in place): a stager's one stripe in a
    staged striped update (its buckets every K-th of the update, then the stripe's final header), a part group's
    stream over a rail of its own (:mod:`.groups`)."""

    def __init__(self, source: ReceiverTransport, what: str, route: tuple[int, list[str]] | None) -> None:
        self._source, self._what, self._route = source, what, route
        self.capacity = source.capacity

    def receive(self, deadline: float) -> ReceivedBucket:
        try:
            return self._source.receive(deadline)
        except Exception as exc:
            named = on_rail(exc, self._what, self._route)
            if named is exc:
                raise
            raise named from exc

    def release(self, token: int) -> None:
        self._source.release(token)

    def close(self) -> None:
        self._source.close()


def chain_metadata(metadata: WorldMetadata) -> tuple[list[ChainMetadata], list[ChainMetadata]]:
    """Every worker's metadata as the chain reads it, actor ranks and rollout ranks."""
    def decoded(entries: Sequence[WorkerMetadata], side: str) -> list[ChainMetadata]:
        return [decode_metadata(entry, ChainMetadata, who=f"{side} rank {rank}") for rank, entry in enumerate(entries)]

    return decoded(metadata.actor, "actor"), decoded(metadata.rollout, "rollout")


def stripes_for(metadata: WorldMetadata) -> list[int]:
    """The rails :func:`striped_topology` deals an update over, one stripe each (stripe s on the s-th), from the
    workers' metadata: just rail 0 unless actor rank 0 asks for stripes (``stripes``, two-level layout); then
    :func:`stripe_rails` of the rails reported, as many as asked for (an int), or those listed (a list of rails).
    In a staged update (``staged``) each stager holds one stripe, so rollout workers on the sender's host, if any,
    must also be on each of the rails."""
    actor, rollout = chain_metadata(metadata)
    asked = actor[0].stripes
    if actor[0].layout != "two_level" or asked == 1:
        return [0]
    sender_node = actor[0].node_id
    where = [(worker.node_id, worker.rail) for worker in rollout]
    rails = stripe_rails(sender_node=sender_node, rollout=where, limit=asked if isinstance(asked, int) else None,
                         wanted=asked if isinstance(asked, list) else None,
                         sender_rails=[worker.rail for worker in actor if worker.node_id == sender_node])
    local = {rail for node, rail in where if node == sender_node}
    if actor[0].staged and local:
        rails = [rail for rail in rails if rail in local] if 0 in local else [0]
    return rails


def stripe_senders(library: str, actor: list[ChainMetadata], rails: list[int]) -> list[int]:
    """Each stripe's sender: the first actor rank on its rail of the sender's host, which must have advertised an
    endpoint."""
    sender_node = actor[0].node_id
    senders = [next(rank for rank, worker in enumerate(actor) if (worker.node_id, worker.rail) == (sender_node, rail))
               for rail in rails]
    for rank in senders:
        if not actor[rank].address or actor[rank].library != library:
            raise TopologyError(f"actor rank {rank} sends a stripe but did not advertise a {library} endpoint")
    return senders


class Dealt:
    """Every rank's plan as stripes are dealt (:func:`deal`): the actor ranks' and the rollout ranks' (idle until
    dealt), and each rollout rank's sources, one per stripe it reads."""

    def __init__(self, actor: int, rollout: int, sender: int) -> None:
        self.actor: list[RankPlan] = [Idle(sender=sender) for _ in range(actor)]
        self.rollout: list[RankPlan] = [Idle(sender=sender) for _ in range(rollout)]
        self.sources: list[list[Source]] = [[] for _ in range(rollout)]

    def receivers(self, ranks: Sequence[int], sender: int) -> None:
        """Rollout ``ranks``, each reading its sources (of ``sender``'s stripes): one chain, or every stripe."""
        for rank in ranks:
            mine = tuple(self.sources[rank])
            self.rollout[rank] = ChainReceive(sender=sender, rank=rank, source=mine[0]) if len(mine) == 1 else \
                StripesReceive(sender=sender, rank=rank, sources=mine)


def deal(dealt: Dealt, *, actor: list[ChainMetadata], rollout: list[ChainMetadata], addresses: list[str],
         fanout: int, senders: list[int], rails: list[int], taking: list[int] | None = None, staged: bool = False,
         held: PartPlan | None = None) -> None:
    """Deal one stream into ``len(rails)`` stripes (one: a plain two-level chain), stripe s over rail ``rails[s]``
    from actor rank ``senders[s]``, to the rollout ranks ``taking`` (default every one; staged: each stripe to those
    on its rail, a :class:`ChainReceive` of that stripe each); ``held``: what those ranks' hosts hold together (a
    part group's), each sender leaving out what they hold nothing of and sending of the tensors they hold regions of
    only those regions' span."""
    count = len(rails)
    nodes = [actor[0].node_id, *(worker.node_id for worker in rollout)]
    on_rail = [0, *(worker.rail for worker in rollout)]
    ranks = list(range(len(rollout))) if taking is None else taking
    for stripe, (sender, rail) in enumerate(zip(senders, rails)):
        # Positions taking part in this stripe: the sender, and the rollout ranks (staged: those on its rail).
        positions = [0, *(rank + 1 for rank in ranks if not staged or on_rail[rank + 1] == rail)]
        plan = plan_stripe(nodes=[nodes[p] for p in positions], rails=[on_rail[p] for p in positions], rail=rail,
                           fanout=fanout)
        where = [actor[sender].address, *addresses]
        workers = [actor[sender], *rollout]
        dealt_as = Stripe(stripe, count) if count > 1 else None
        children, in_place = plan.downstream(0, positions)
        dealt.actor[sender] = ChainSend(sender=sender, stripe=dealt_as, children=children, in_place=in_place,
                                        skip=held.none() if held else (), carry=held.regions() if held else {})
        for i, position in enumerate(positions[1:], start=1):
            children, in_place = plan.downstream(i, positions)
            upstream = positions[plan.upstream[i]]
            name = f"actor rank {sender}" if upstream == 0 else f"rollout rank {upstream - 1}"
            # Errors name the peer by this: which stripe, over which rail, between which hosts.
            ends = (workers[upstream].host_name, workers[position].host_name)
            how = "in place" if plan.local[i] else f"rail {rail} from host {ends[0]} to host {ends[1]}"
            what = f" (stripe {stripe}, {how})" if count > 1 else f" ({how})"
            source = Source(upstream=where[upstream], upstream_position=upstream, local=plan.local[i],
                            children=children, in_place=in_place, peer=f"{name}{what}",
                            route=Route(rail=rail, hosts=ends))
            if staged:
                dealt.rollout[position - 1] = ChainReceive(sender=sender, rank=position - 1, source=source,
                                                           stripe=dealt_as)
            else:
                dealt.sources[position - 1].append(source)


def striped_topology(library: str, metadata: WorldMetadata, *, fanout: int, addresses: list[str]) -> Topology | None:
    """The two-level chain dealt into stripes over the rails the workers report (``rail``), or None where only one
    stripe fits (:func:`stripes_for`). ``addresses``: each rollout rank's endpoint.

    Stripe s goes over the s-th of the rails (``stripes_for``): its sender is the sender host's first actor rank on
    that rail, its plan :func:`plan_stripe`'s. An actor rank's plan says its ``stripe``. A rollout rank's plan
    (:class:`StripesReceive`) has one source per stripe (its upstream, and for the stripe it leads its children). In
    a staged update (``staged``) every rollout rank is a stager on the rail of one stripe s and takes part in that
    stripe alone: its plan is a :class:`ChainReceive` of that stripe's source, with its ``stripe``."""
    used = stripes_for(metadata)
    if len(used) == 1:
        return None
    actor, rollout = chain_metadata(metadata)
    senders = stripe_senders(library, actor, used)
    dealt = Dealt(len(actor), len(rollout), senders[0])
    deal(dealt, actor=actor, rollout=rollout, addresses=addresses, fanout=fanout, senders=senders, rails=used,
         staged=actor[0].staged)
    if not actor[0].staged:
        dealt.receivers(range(len(rollout)), senders[0])
    return Topology(actor=[encode_plan(plan) for plan in dealt.actor],
                    rollout=[encode_plan(plan) for plan in dealt.rollout], senders=tuple(senders), stripes=len(used))
