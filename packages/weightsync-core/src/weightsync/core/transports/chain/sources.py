"""A sharded ``actor_wg`` across hosts (:mod:`weightsync.core.transports.sources`): each sending rank's stream over a
two-level chain of its own.

Stream s (the shards of ``senders[s]``) goes from its sender's host to every rollout host once: on each host its
leader reads it over the network, on the sender's rail where the host has workers on it (a rail is a network of its
own; a rank per rail, as a striped update's senders), and the host's other workers read the leader's ring in place.
The leaders of a host's streams are different workers (each worker's engine has one ring); a host with fewer
workers (on a sender's rail) than there are streams to lead cannot be served yet (a ``TopologyError``, before any
pause: a worker would need a ring per stream it leads). The senders may be on different hosts. Every rollout
worker's plan (:class:`StreamsReceive`) has one source per stream, in the senders' order.

Staged (``weightsync.core.control.staged``), the rollout world is each host's stagers, one per stream
(:func:`stream_rails`): each stages one sender's stream into an area of its own, so each stream's plan holds its
sender and the stager of each host that stages it (on the sender's rail where the host has one), and that stager's
plan has that one source. Every worker's swap reads the host's areas together.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.errors import TopologyError
from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.transports.chain.plan import ChainMetadata, ChainSend, Route, Source, StreamsReceive
from weightsync.core.transports.chain.topology import ChainPlan, two_level_plan
from weightsync.core.transports.plan import Idle, RankPlan, decode_metadata, encode_plan
from weightsync.core.transports.sources import SourcesPlan, plan_sources

__all__ = ["sharded_topology", "stream_rails"]


def sharded_topology(library: str, metadata: WorldMetadata, sources: SourcesPlan, *, fanout: int,
                     addresses: Sequence[str]) -> Topology:
    """The topology of a sharded ``actor_wg`` over the two-level chain (module docstring). ``addresses``: each
    rollout rank's endpoint."""
    actor = [decode_metadata(entry, ChainMetadata, who=f"actor rank {rank}") for rank, entry in
             enumerate(metadata.actor)]
    rollout = [decode_metadata(entry, ChainMetadata, who=f"rollout rank {rank}") for rank, entry in
               enumerate(metadata.rollout)]
    for rank in sources.senders:
        if not actor[rank].address or actor[rank].library != library:
            raise TopologyError(f"actor rank {rank} holds shards to send but did not advertise a {library} endpoint")
    senders = sources.senders
    first = senders[0]
    actor_plans: list[RankPlan] = [Idle(sender=first) for _ in actor]
    mine: list[list[Source]] = [[] for _ in rollout]
    streams: list[list[int]] = [[] for _ in rollout]
    staged = _staged_streams(actor, rollout, senders) if actor[0].staged else None
    leading: set[int] = set()
    for sender in senders:
        # The positions of the stream's plan (0: its sender; p: rollout rank p - 1): every rollout rank, or staged the
        # stagers that stage this stream (one per host).
        positions = [0, *(staged[sender] if staged is not None else range(1, len(rollout) + 1))]
        plan = _stream_plan(actor[sender], [rollout[p - 1] for p in positions[1:]],
                            leading if staged is None else set(), fanout)
        children, in_place = plan.downstream(0, positions)
        actor_plans[sender] = ChainSend(sender=sender, children=children, in_place=in_place,
                                        skip=sources.skip[sender])
        workers, where = [actor[sender], *rollout], [actor[sender].address, *addresses]
        for at, position in enumerate(positions[1:], start=1):
            upstream = positions[plan.upstream[at]]
            children, in_place = plan.downstream(at, positions)
            name = f"actor rank {sender}" if upstream == 0 else f"rollout rank {upstream - 1}"
            ends = (workers[upstream].host_name, workers[position].host_name)
            how = "in place" if plan.local[at] else f"rail {workers[position].rail} from host {ends[0]} to " \
                f"host {ends[1]}"
            mine[position - 1].append(Source(
                upstream=where[upstream], upstream_position=upstream,
                local=plan.local[at], children=children, in_place=in_place,
                peer=f"{name} (the shards of actor rank {sender}, {how})",
                route=None if plan.local[at] else Route(rail=workers[position].rail, hosts=ends)))
            streams[position - 1].append(sender)
    rollout_plans = [StreamsReceive(sender=first, rank=rank, sources=tuple(sourced), streams=tuple(streams[rank]))
                     for rank, sourced in enumerate(mine)]
    return Topology(actor=[encode_plan(plan) for plan in actor_plans],
                    rollout=[encode_plan(plan) for plan in rollout_plans], senders=senders, sharded=True)


def stream_rails(metadata: WorldMetadata) -> list[int] | None:
    """A staged update's streams across hosts (``weightsync.core.control.staged``: a stager per stream on every
    host): the rail of each sending rank of a sharded ``actor_wg`` sending over the two-level chain, in the senders'
    order; None for any other world."""
    actor = [decode_metadata(entry, ChainMetadata, who=f"actor rank {rank}") for rank, entry in
             enumerate(metadata.actor)]
    sources = plan_sources(metadata) if actor and actor[0].layout == "two_level" else None
    return [actor[rank].rail for rank in sources.senders] if sources is not None else None


def _staged_streams(actor: Sequence[ChainMetadata], rollout: Sequence[ChainMetadata], senders: Sequence[int]
                    ) -> dict[int, list[int]]:
    """Staged, the rollout world is every host's stagers, one per stream (``StagedPlan``): which of them stages which
    sender's stream (positions, rollout rank + 1): on each host the first one left on the sender's rail, else the
    first one left."""
    hosts: dict[str, list[int]] = {}
    for position, worker in enumerate(rollout, start=1):
        hosts.setdefault(worker.node_id, []).append(position)
    staging: dict[int, list[int]] = {sender: [] for sender in senders}
    for positions in hosts.values():
        left = list(positions)
        for sender in senders:
            pick = next((p for p in left if rollout[p - 1].rail == actor[sender].rail), left[0] if left else None)
            if pick is None:
                raise TopologyError(f"host {rollout[positions[0] - 1].host_name} has {len(positions)} stagers for "
                                    f"{len(senders)} sending ranks: a staged update from a sharded actor_wg stages "
                                    "each rank's stream on a stager of its own")
            left.remove(pick)
            staging[sender].append(pick)
        if left:
            raise TopologyError(f"host {rollout[positions[0] - 1].host_name} has stagers {left} with no sending rank's "
                                "stream to stage")
    return {sender: sorted(positions) for sender, positions in staging.items()}


def _stream_plan(sender: ChainMetadata, rollout: Sequence[ChainMetadata], leading: set[int], fanout: int
                 ) -> ChainPlan:
    """The two-level plan of one sender's stream: position 0 the sender, position p rollout rank p - 1; each other
    host's leader its first worker that leads no stream yet (``leading``, updated), among those on the sender's rail
    where the host has any."""
    nodes = [sender.node_id, *(worker.node_id for worker in rollout)]
    hosts: dict[str, list[int]] = {}
    for position in range(1, len(nodes)):
        hosts.setdefault(nodes[position], []).append(position)
    leader_of = {nodes[0]: 0}
    for node, positions in hosts.items():
        if node == nodes[0]:
            continue  # the sender's host: its workers read the sender's ring in place
        on_rail = [p for p in positions if rollout[p - 1].rail == sender.rail]
        # A rail is a network of its own: where the host has workers on the sender's rail, one of them leads.
        free = [p for p in on_rail or positions if p not in leading]
        if not free:
            raise TopologyError(f"host {rollout[positions[0] - 1].host_name} has {len(on_rail or positions)} rollout "
                                f"workers on rail {sender.rail} for more sending ranks on it: each leads one rank's "
                                "stream into the host (not built: a ring per stream)")
        leader_of[node] = free[0]
        leading.add(free[0])
    return two_level_plan(nodes, fanout, leader_of)
