"""Who reads from whom in the chain (:mod:`weightsync.core.transports.chain.transport`): the rank-order tree, and the two-level layout.

Positions: 0 is actor rank 0 (the only sender), position p >= 1 is rollout rank p - 1.

``chain`` (the default layout): the upstream of position p is ``(p - 1) // fanout`` — with fan-out 1 the chain
rank0 → r0 → r1 → … in rank order, whatever the hosts.

``two_level``: hosts first. Every host has one *leader*: on the sender's host the sender itself, on every other host
its first rollout rank. Leaders form the tree above among themselves (the sender, then the other hosts' leaders in
the order their hosts first appear), so each byte crosses every link once: the sender's link carries one model
out, every other host's link one model in and at most ``fanout`` out. Every other worker of a host reads its
leader's ring in place, through shared memory (``local``): the leader's receive buffer is its host's ring, no
library transfer and no extra copy. Host identity is the workers' ``node_id`` (a Ray node, a testbed host).

Striped (``two_level`` with K > 1 stripes, :mod:`weightsync.core.transports.chain.stripes`): each stripe has a two-level
plan of its own (:func:`plan_stripe`), over a rail of its own (:func:`stripe_rails`: rails 0..K-1, less any rail
left out). Its sender is the sender host's actor rank on that rail; on every other host its leader is the first
worker on that rail, which reads the stripe over it; every other worker of the host reads each stripe in place from
that stripe's leader. So each rail in use on every host carries 1/K of the model.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["LAYOUTS", "ChainPlan", "chain_positions", "plan_positions", "plan_stripe", "position_name", "stripe_rails",
           "two_level_plan"]

LAYOUTS = ("chain", "two_level")


def position_name(position: int) -> str:
    return "actor rank 0" if position == 0 else f"rollout rank {position - 1}"


def chain_positions(*, rollout_world_size: int, fanout: int) -> list[list[int]]:
    """Children of every position (0 = the sender, p = rollout rank p - 1) of a ``fanout``-ary tree in rank order."""
    children: list[list[int]] = [[] for _ in range(rollout_world_size + 1)]
    for position in range(1, rollout_world_size + 1):
        children[(position - 1) // fanout].append(position)
    return children


@dataclass(frozen=True)
class ChainPlan:
    """``upstream[p]`` (-1 for the sender), ``children[p]``, and ``local[p]``: p reads its upstream's ring in
    place (same host) rather than through the transfer library."""

    upstream: list[int]
    children: list[list[int]]
    local: list[bool]

    def downstream(self, i: int, positions: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Position ``i``'s children, and those of them that read its ring in place, as ``positions`` numbers
        them (a plan over some of the positions: a stripe's, a part group's)."""
        return (tuple(positions[child] for child in self.children[i]),
                tuple(positions[child] for child in self.children[i] if self.local[child]))


def plan_positions(*, nodes: list[str], fanout: int, layout: str) -> ChainPlan:
    """The plan for positions on ``nodes`` (``nodes[p]``: position p's host, ``nodes[0]`` the sender's)."""
    count = len(nodes)
    if layout == "chain":
        upstream = [-1, *((p - 1) // fanout for p in range(1, count))]
        return ChainPlan(upstream=upstream, children=chain_positions(rollout_world_size=count - 1, fanout=fanout),
                         local=[False] * count)
    leader_of: dict[str, int] = {}
    for position, node in enumerate(nodes):
        leader_of.setdefault(node, position)  # the sender leads its host; elsewhere the first rollout rank
    return two_level_plan(nodes, fanout, leader_of)


def plan_stripe(*, nodes: list[str], rails: list[int], rail: int, fanout: int) -> ChainPlan:
    """A stripe's two-level plan, the stripe carried by rail ``rail``: position 0 is the stripe's sender, and on
    every other host the leader is its first rollout rank on that rail (``rails[p]``), which reads the stripe over
    it; the host's other workers read the leader's ring in place."""
    leader_of: dict[str, int] = {nodes[0]: 0}
    for position in range(1, len(nodes)):
        if rails[position] == rail:
            leader_of.setdefault(nodes[position], position)
    for position in range(1, len(nodes)):
        leader_of.setdefault(nodes[position], position)  # a host without that rail: its first worker leads
    return two_level_plan(nodes, fanout, leader_of)


def stripe_rails(*, sender_node: str, sender_rails: Sequence[int], rollout: Sequence[tuple[str, int]],
                 limit: int | None = None, wanted: Sequence[int] | None = None,
                 leaving_out: Collection[int] = ()) -> list[int]:
    """The rails a two-level update can be dealt over, one stripe each, in rail order: rail 0 (the control plane's)
    and every other rail that has an actor rank on the sender's host (``sender_rails``) and a worker on every other
    host (``rollout``: each rollout worker's host and rail), less ``leaving_out`` (rails lost and not yet back),
    only those in ``wanted`` when given, at most ``limit``. Just rail 0 (one stripe: unstriped) where rail 0 is not
    common to every host, any host has a single rail, or no worker is on another host."""
    hosts: dict[str, set[int]] = {}
    for node, rail in rollout:
        if node != sender_node:
            hosts.setdefault(node, set()).add(rail)
    common = set(sender_rails).intersection(*hosts.values()) if hosts else set()
    if 0 not in common:
        return [0]
    usable = [rail for rail in sorted(common) if rail == 0 or (
        rail not in leaving_out and (wanted is None or rail in wanted))]
    return usable[:limit] if limit is not None else usable


def two_level_plan(nodes: list[str], fanout: int, leader_of: dict[str, int]) -> ChainPlan:
    """The two-level plan of positions on ``nodes`` whose host leaders are ``leader_of`` (node -> position)."""
    count = len(nodes)
    leaders = sorted(set(leader_of.values()))
    upstream = [-1] * count
    local = [False] * count
    for index, leader in enumerate(leaders[1:], start=1):
        upstream[leader] = leaders[(index - 1) // fanout]
    for position in range(1, count):
        leader = leader_of[nodes[position]]
        if leader != position:
            upstream[position], local[position] = leader, True
    children: list[list[int]] = [[] for _ in range(count)]
    for position, parent in enumerate(upstream):
        if parent >= 0:
            children[parent].append(position)
    return ChainPlan(upstream=upstream, children=children, local=local)
