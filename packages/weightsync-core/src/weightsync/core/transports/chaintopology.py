"""Who reads from whom in the chain (:mod:`weightsync.core.transports.chain`): the rank-order tree, and the two-level layout.

Positions: 0 is actor rank 0 (the only sender), position p >= 1 is rollout rank p - 1.

``chain`` (the default layout): the upstream of position p is ``(p - 1) // fanout`` — with fan-out 1 the chain
rank0 → r0 → r1 → … in rank order, whatever the hosts.

``two_level``: hosts first. Every host has one *leader*: on the sender's host the sender itself, on every other host
its first rollout rank. Leaders form the tree above among themselves (the sender, then the other hosts' leaders in
the order their hosts first appear), so each byte crosses every link once: the sender's link carries one model
out, every other host's link one model in and at most ``fanout`` out. Every other worker of a host reads its
leader's ring in place, through shared memory (``local``): the leader's receive buffer is its host's ring, no
library transfer and no extra copy. Host identity is the workers' ``node_id`` (a Ray node, a testbed host).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LAYOUTS", "ChainPlan", "chain_positions", "plan_positions", "position_name"]

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
