"""Delivery by part across hosts: the two-level chain split into part groups.

Where rollout workers declared parts (``weightsync.api.parts``) and the hosts differ in what they hold, each group of
hosts that skip the same tensors (:func:`~weightsync.core.wire.partplans.part_groups`: none of their workers holds
anything of them) gets a stream of its own: its own sender (actor rank g of the sender's host), which leaves those
tensors out (``RankPlan.skip``), and a two-level chain over the group's hosts alone, on that sender's rail (each
host's leader is its first worker on it). So the sender's host sends each
group its part once, and a host takes in only what its workers hold (rounded up to whole tensors). In a staged
update the receivers are the hosts' stagers, each declaring what its host's workers hold together
(:func:`weightsync.core.control.parts.members_metadata`): a host stages only that.

With several rails (``auto`` deals a full update into stripes, one per rail: :mod:`.stripes`) the groups share them
out: with K rails and G groups each group takes K // G rails of its own (group g the g-th run of them) and deals its
stream into that many stripes, each from the sender's actor rank on its rail, to the group's hosts alone. So the
sender's host still sends the model once, spread over its rails, and each host takes in only its part, over its
group's rails. A staged update, or fewer rails than groups, keeps the stripes over every rail: every host then takes
in the whole model, and each worker still reads and verifies only its part.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.transports.chain.plan import ChainMetadata
from weightsync.core.transports.chain.stripes import Dealt, deal, stripe_senders, stripes_for
from weightsync.core.transports.plan import decode_metadata, encode_plan
from weightsync.core.wire.partplans import declared_parts, part_groups

__all__ = ["grouped_topology"]


def grouped_topology(library: str, metadata: WorldMetadata, *, fanout: int, addresses: Sequence[str]
                     ) -> Topology | None:
    """The chain split into part groups (over rails of their own where the update is dealt into stripes), or None
    where one stream serves every host (no parts, or every host needs the same tensors), the sender's host has fewer
    actor ranks than there are groups, or the stripes stay over every rail (module docstring)."""
    parts = declared_parts(metadata.rollout, [f"rollout rank {rank}" for rank in range(len(metadata.rollout))])
    if all(part is None for part in parts):
        return None
    actor = [decode_metadata(entry, ChainMetadata, who=f"actor rank {rank}") for rank, entry in
             enumerate(metadata.actor)]
    if actor[0].layout != "two_level":
        return None  # the rank-order chain is not by host
    rollout = [decode_metadata(entry, ChainMetadata, who=f"rollout rank {rank}") for rank, entry in
               enumerate(metadata.rollout)]
    hosts = [worker.node_id for worker in rollout]
    groups = part_groups(parts, hosts)
    if len(groups) < 2:
        return None
    used = stripes_for(metadata)
    per = len(used) // len(groups)
    sender_node = actor[0].node_id
    if len(used) > 1:
        if actor[0].staged or per == 0:
            return None
        rails = [used[g * per:(g + 1) * per] for g in range(len(groups))]
        senders = [stripe_senders(library, actor, mine) for mine in rails]
    else:  # one stream per group, each over its sender's rail
        ranks = [rank for rank, worker in enumerate(actor) if worker.node_id == sender_node and worker.address]
        if len(ranks) < len(groups):
            return None
        senders = [[rank] for rank in ranks[:len(groups)]]
        rails = [[actor[rank].rail] for rank in ranks[:len(groups)]]
    dealt = Dealt(len(actor), len(rollout), senders[0][0])
    for g, (skipped, members) in enumerate(groups):
        taking = [rank for rank, host in enumerate(hosts) if host in members]
        deal(dealt, actor=actor, rollout=rollout, addresses=list(addresses), fanout=fanout, senders=senders[g],
             rails=rails[g], taking=taking, skip=tuple(sorted(skipped)))
        dealt.receivers(taking, senders[g][0])
    stripes = len(senders[0])
    return Topology(actor=[encode_plan(plan) for plan in dealt.actor],
                    rollout=[encode_plan(plan) for plan in dealt.rollout],
                    senders=tuple(rank for group in senders for rank in group), stripes=stripes,
                    groups=len(groups) if stripes > 1 else 1)
