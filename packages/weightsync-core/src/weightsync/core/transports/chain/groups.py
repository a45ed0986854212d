"""Delivery by part across hosts: the two-level chain split into part groups.

Where rollout workers declared parts (``weightsync.api.parts``) and the hosts differ in what they hold, each group of
hosts that skip the same tensors (:func:`~weightsync.core.wire.partplans.part_groups`: none of their workers holds
anything of them) gets a stream of its own: its own sender (actor rank g of the sender's host), which leaves those
tensors out (``RankPlan.skip``), and a two-level chain over the group's hosts alone. So the sender's host sends each
group its part once, and a host takes in only what its workers hold (rounded up to whole tensors). In a staged
update the receivers are the hosts' stagers, each declaring what its host's workers hold together
(:func:`weightsync.core.control.parts.members_metadata`): a host stages only that.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.transports.chain.plan import ChainMetadata, ChainReceive, ChainSend, Source
from weightsync.core.transports.chain.topology import plan_positions
from weightsync.core.transports.plan import Idle, RankPlan, decode_metadata, encode_plan
from weightsync.core.wire.partplans import declared_parts, part_groups

__all__ = ["grouped_topology"]


def grouped_topology(library: str, metadata: WorldMetadata, *, fanout: int, addresses: Sequence[str]
                     ) -> Topology | None:
    """The chain split into part groups, or None where one stream serves every host (no parts, or every host
    needs the same tensors) or the sender's host has fewer actor ranks than there are groups."""
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
    sender_node = actor[0].node_id
    senders = [rank for rank, worker in enumerate(actor) if worker.node_id == sender_node and worker.address]
    if len(groups) < 2 or len(senders) < len(groups):
        return None
    actor_plans: list[RankPlan] = [Idle(sender=senders[0]) for _ in actor]
    rollout_plans: list[RankPlan] = [Idle(sender=senders[0]) for _ in rollout]
    for (skipped, members), sender in zip(groups, senders):
        taking = [0, *(rank + 1 for rank, host in enumerate(hosts) if host in members)]
        nodes = [sender_node, *(hosts[position - 1] for position in taking[1:])]
        plan = plan_positions(nodes=nodes, fanout=fanout, layout="two_level")
        where = [actor[sender].address, *addresses]

        children, in_place = plan.downstream(0, taking)
        actor_plans[sender] = ChainSend(sender=sender, children=children, in_place=in_place,
                                        skip=tuple(sorted(skipped)))
        for i, position in enumerate(taking[1:], start=1):
            upstream = taking[plan.upstream[i]]
            children, in_place = plan.downstream(i, taking)
            rollout_plans[position - 1] = ChainReceive(sender=sender, rank=position - 1, source=Source(
                upstream=where[upstream], upstream_position=upstream, local=plan.local[i], children=children,
                in_place=in_place))
    return Topology(actor=[encode_plan(plan) for plan in actor_plans],
                    rollout=[encode_plan(plan) for plan in rollout_plans], senders=tuple(senders[:len(groups)]))
