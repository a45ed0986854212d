"""Delivery by part across hosts: the two-level chain split into part groups.

Where rollout workers declared parts (``weightsync.api.parts``) and the hosts differ in what they hold, each group of
hosts that skip the same tensors (:func:`~weightsync.core.wire.partplans.part_groups`: none of their workers holds
anything of them) gets a stream of its own: its own sender (actor rank g of the sender's host), which leaves those
tensors out (``RankPlan.skip``), and a two-level chain over the group's hosts alone, on that sender's rail (each
host's leader is its first worker on it). So the sender's host sends each group its part once, and a host takes in
only what its workers hold (rounded up to whole tensors). In a staged update the receivers are the hosts' stagers,
each declaring what its host's workers hold together (:func:`weightsync.core.control.parts.members_metadata`): a
host stages only that.

With several rails (``auto`` deals a full update into stripes, one per rail: :mod:`.stripes`) the groups share them
out (:func:`rail_groups`): with K rails and G groups each group takes K // G rails of its own and deals its stream
into that many stripes, each from the sender's actor rank on its rail, to the group's hosts alone. So the sender's
host still sends the model once, spread over its rails, and each host takes in only its part, over its group's
rails; staged, each host's stagers are its workers on those rails, one stripe each. With fewer rails than groups
the stripes stay over every rail: every host then takes in the whole model, and each worker still reads and
verifies only its part.

A group's stream over a rail > 0 that fails names its rail (``stripes.OnRail``); the manager leaves that rail out
(the ``left_out`` option, from ``auto``: :mod:`weightsync.core.control.rails`) until a probe reaches it again, and
no group is dealt over a rail left out: the groups share the rails left, or, with fewer senders on them than groups,
one two-level stream over rail 0 serves every host.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.transports.chain.plan import ChainMetadata
from weightsync.core.transports.chain.stripes import Dealt, chain_metadata, deal, stripe_senders, stripes_for
from weightsync.core.transports.plan import encode_plan
from weightsync.core.wire.partplans import PartPlan, declared_parts, part_groups

__all__ = ["grouped_topology", "rail_groups"]


def rail_groups(metadata: WorldMetadata) -> list[tuple[PartPlan, list[str], list[int]]] | None:
    """Where the part groups share the rails out (module docstring): each group's part (what its hosts hold
    together), hosts and rails, in the order of their hosts' names; None where actor rank 0 asks for no stripes (or
    not two-level), the hosts do not differ in what they hold, or the rails do not go round (fewer than groups, or a
    group's hosts lacking one of its rails). The rails are those asked for (``stripes``) that have an actor rank on
    the sender's host and a worker on every host of some group, K // G of them to each group in rail order. A staged
    update's manager picks each host's stagers on its group's rails by this, from every worker's metadata; the
    topology, built from the stagers' (each declaring what its host holds: the same groups), finds the same
    rails."""
    return _shared_out(*_decoded(metadata))


def _decoded(metadata: WorldMetadata) -> tuple[list[PartPlan | None], list[ChainMetadata], list[ChainMetadata]]:
    """The rollout workers' parts, and every worker's metadata as the chain reads it."""
    parts = declared_parts(metadata.rollout, [f"rollout rank {rank}" for rank in range(len(metadata.rollout))])
    return (parts, *chain_metadata(metadata))


def _shared_out(parts: list[PartPlan | None], actor: list[ChainMetadata], rollout: list[ChainMetadata]
                ) -> list[tuple[PartPlan, list[str], list[int]]] | None:
    """:func:`rail_groups` of the decoded metadata."""
    asked = actor[0].stripes
    if actor[0].layout != "two_level" or asked == 1 or all(part is None for part in parts):
        return None
    groups = _groups(parts, rollout)
    sender_rails = {worker.rail for worker in actor if worker.node_id == actor[0].node_id}
    commons = [sender_rails.intersection(*({worker.rail for worker in rollout if worker.node_id == host}
                                           for host in members)) for _, members in groups]
    rails = [rail for rail in sorted(set().union(*commons))
             if (not isinstance(asked, list) or rail in asked) and rail not in actor[0].left_out]
    rails = rails[:asked] if isinstance(asked, int) else rails
    per = len(rails) // len(groups)
    dealt = [rails[g * per:(g + 1) * per] for g in range(len(groups))]
    if len(groups) < 2 or per == 0 or 0 not in rails or any(not set(mine) <= common
                                                          for mine, common in zip(dealt, commons)):
        return None
    return [(held, members, mine) for (held, members), mine in zip(groups, dealt)]


def _groups(parts: list[PartPlan | None], rollout: list[ChainMetadata]) -> list[tuple[PartPlan, list[str]]]:
    """:func:`part_groups` over the rollout workers' hosts, in the order of the hosts' names (so the rails go to
    them in an order a person can predict: the first host's group gets rail 0)."""
    names = {worker.node_id: worker.host_name for worker in rollout}
    groups = part_groups(parts, [worker.node_id for worker in rollout])
    return sorted(groups, key=lambda group: sorted(names[host] for host in group[1]))


def grouped_topology(library: str, metadata: WorldMetadata, *, fanout: int, addresses: Sequence[str]
                     ) -> Topology | None:
    """The chain split into part groups (over rails of their own where there are stripes: :func:`rail_groups`), or
    None where one stream serves every host (no parts, or every host needs the same tensors), the sender's host has
    fewer actor ranks than there are groups, or the stripes stay over every rail (module docstring)."""
    parts, actor, rollout = _decoded(metadata)
    if all(part is None for part in parts) or actor[0].layout != "two_level":
        return None  # no parts; or the rank-order chain, which is not by host
    hosts = [worker.node_id for worker in rollout]
    sender_node = actor[0].node_id
    striped = _shared_out(parts, actor, rollout)
    if striped is not None:
        groups = [(held, members) for held, members, _ in striped]
        rails = [mine for _, _, mine in striped]
        if actor[0].staged and any(sorted(worker.rail for worker in rollout if worker.node_id == host) != mine
                                   for (_, members), mine in zip(groups, rails) for host in members):
            return None  # the stagers were picked for other rails (StagedPlan): the stripes stay over them
        senders = [stripe_senders(library, actor, mine) for mine in rails]
    elif len(stripes_for(metadata)) > 1:
        return None  # the stripes stay over every rail
    else:  # one stream per group, each over its sender's rail
        groups = _groups(parts, rollout)
        ranks = [rank for rank, worker in enumerate(actor)
                 if worker.node_id == sender_node and worker.address and worker.rail not in actor[0].left_out]
        if len(groups) < 2 or len(ranks) < len(groups):
            return None
        senders = [[rank] for rank in ranks[:len(groups)]]
        rails = [[actor[rank].rail] for rank in ranks[:len(groups)]]
    staged = actor[0].staged and len(senders[0]) > 1  # each stager stages the stripe of its rail
    dealt = Dealt(len(actor), len(rollout), senders[0][0])
    for g, (held, members) in enumerate(groups):
        taking = [rank for rank, host in enumerate(hosts) if host in members]
        deal(dealt, actor=actor, rollout=rollout, addresses=list(addresses), fanout=fanout, senders=senders[g],
             rails=rails[g], taking=taking, held=held, staged=staged)
        if not staged:
            dealt.receivers(taking, senders[g][0])
    stripes = len(senders[0])
    return Topology(actor=[encode_plan(plan) for plan in dealt.actor],
                    rollout=[encode_plan(plan) for plan in dealt.rollout],
                    senders=tuple(rank for group in senders for rank in group), stripes=stripes,
                    groups=len(groups) if stripes > 1 else 1)
