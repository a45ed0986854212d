"""Each host's links (its rails): how they are shaped, how they go down and up, and how their bytes are counted.

A host has K rails (``Testbed(rails=K)``, one by default), as a GPU node has a NIC per GPU. Rail k of host i is
one veth pair: ``eth<k>`` in the host's namespace with address 198.18.k.(i+1)/24, its peer (``wst-h<i>`` for rail 0,
``wst-h<i>r<k>`` for the others) in the switch namespace, enslaved to that rail's own bridge (``wst-br``,
``wst-br<k>``): each rail is a network of its own, as in a rail-optimised fabric, so a host's rail-k address is
reached over rail k only and Linux sends each rail's traffic out of its own interface (its subnet's route). Rail 0
carries everything that is not addressed to another rail (Ray, the stores, the manager's pings). Shaping is ``tc``
on the egress of each end, so each direction of each rail has its own bottleneck:

- host → switch (the host's egress): a qdisc on the host's ``eth<k>``;
- switch → host (the host's ingress): a qdisc on the switch-side port.

Both are ``tbf rate X burst max(256KiB, 1 ms × X) latency 20ms``. The burst matters: one TCP stream over a 2 Gb/s
link measured 1.0 Gb/s with a 32 KiB burst, 1.67 with 64 KiB, 1.9 with 256 KiB on this project's machine (veth
hands tbf GSO segments of up to 64 KiB), and a burst much larger than 1 ms of the rate lets short transfers beat
the link. With an RTT, the host's
egress gets ``netem delay RTT/2`` as the root with the tbf under it (netem's documented way to shape a delayed
link); the switch side has no delay, so any two hosts see the RTT asked for. Many kernels ship without sch_netem
(this project's CI machine among them): an RTT then makes the testbed unavailable, rather than silently absent.

"Link down" drops every packet in both directions: ``mode="drop"`` replaces both roots with the ``blackhole``
qdisc (what ``netem loss 100%`` does, but built into every kernel with tc; the hosts keep carrier, like a cable cut
one hop away), ``mode="carrier"`` sets the switch-side veth down (the host's ``eth0`` loses carrier, like an
unplugged cable). Up restores the shaping.

Counters are read per rail, outside every host, from the switch-side veth: what it received is what the host sent,
what it transmitted is what reached the host (after the ingress shaper, so dropped frames do not count). No process
inside a host can change them, which is what makes them evidence that bytes crossed the link.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LinkCounters", "LinkMode", "MAX_RAILS", "Rail", "blackhole_commands", "build_commands", "parse_counters",
           "rails_of",
           "shaping_commands", "tbf_burst_bytes", "total"]

LinkMode = Literal["drop", "carrier"]

BURST_FLOOR_BYTES = 256 * 1024
TBF_LATENCY_MS = 20
MAX_RAILS = 8
SWITCH = "wst-br"


@dataclass(frozen=True)
class Rail:
    """One of a host's links: ``device`` in the host, ``address`` on it, ``switch_port`` and ``bridge`` in the
    switch namespace."""

    index: int
    device: str
    address: str
    switch_port: str
    bridge: str


def rails_of(host: int, rails: int) -> tuple[Rail, ...]:
    """Host ``host``'s rails 0..rails-1 (rail 0 is the host's address and link of a one-rail testbed)."""
    return tuple(Rail(index=k, device=f"eth{k}", address=f"198.18.{k}.{host + 1}",
                      switch_port=f"wst-h{host}" if k == 0 else f"wst-h{host}r{k}",
                      bridge=SWITCH if k == 0 else f"{SWITCH}{k}") for k in range(rails))


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets on one host's rail (or, ``rail`` -1, all its rails), read from the switch side; subtract
    two readings for a delta.

    ``egress_*``: host → switch (sent by the host); ``ingress_*``: switch → host (received by the host). Bytes are
    whole Ethernet frames (headers included), as the kernel counts them.
    """

    host: int
    egress_bytes: int
    ingress_bytes: int
    egress_packets: int
    ingress_packets: int
    rail: int = 0

    def __sub__(self, earlier: LinkCounters) -> LinkCounters:
        if (earlier.host, earlier.rail) != (self.host, self.rail):
            raise ValueError(f"counters of host {self.host} rail {self.rail} minus counters of host {earlier.host} "
                             f"rail {earlier.rail}")
        return LinkCounters(
            host=self.host,
            egress_bytes=self.egress_bytes - earlier.egress_bytes,
            ingress_bytes=self.ingress_bytes - earlier.ingress_bytes,
            egress_packets=self.egress_packets - earlier.egress_packets,
            ingress_packets=self.ingress_packets - earlier.ingress_packets,
            rail=self.rail,
        )


def total(rails: Sequence[LinkCounters]) -> LinkCounters:
    """One host's counters over all its rails (``rail`` -1); one rail's as they are."""
    if len(rails) == 1:
        return rails[0]
    return LinkCounters(host=rails[0].host, egress_bytes=sum(c.egress_bytes for c in rails),
                        ingress_bytes=sum(c.ingress_bytes for c in rails),
                        egress_packets=sum(c.egress_packets for c in rails),
                        ingress_packets=sum(c.ingress_packets for c in rails), rail=-1)


def build_commands(ip: str, switch_netns: str, hosts: Sequence[tuple[str, Sequence[Rail]]], *, mtu: int
                   ) -> list[list[str]]:
    """The ``ip`` commands that build the switch namespace, every host's network namespace (``hosts``: each one's
    name and rails) and every rail (its bridge, its veth pair, the host's address on it), in order."""
    sw = [ip, "-n", switch_netns]
    steps: list[list[str]] = [[ip, "netns", "add", switch_netns]]
    steps += [[ip, "netns", "add", netns] for netns, _ in hosts]
    # addrgenmode none: no IPv6 link-local addresses, so no neighbour discovery chatter on the counters. It must
    # come in a command before "up": the kernel applies it after the flags of the same command.
    for bridge in {rail.bridge: None for _, rails in hosts for rail in rails}:
        steps += [[*sw, "link", "add", bridge, "mtu", str(mtu), "type", "bridge"],
                  [*sw, "link", "set", bridge, "addrgenmode", "none"], [*sw, "link", "set", bridge, "up"]]
    for netns, rails in hosts:
        inside = [ip, "-n", netns]
        steps.append([*inside, "link", "set", "lo", "up"])
        for rail in rails:
            steps += [
                [*sw, "link", "add", rail.switch_port, "mtu", str(mtu), "type", "veth",
                 "peer", "name", rail.device, "mtu", str(mtu), "netns", netns],
                [*sw, "link", "set", rail.switch_port, "addrgenmode", "none"],
                [*sw, "link", "set", rail.switch_port, "master", rail.bridge, "up"],
                [*inside, "link", "set", rail.device, "addrgenmode", "none"],
                [*inside, "addr", "add", f"{rail.address}/24", "dev", rail.device],
                [*inside, "link", "set", rail.device, "up"],
            ]
    return steps


def tbf_burst_bytes(link_gbps: float) -> int:
    """``max(256 KiB, 1 ms × rate)`` in bytes."""
    return max(BURST_FLOOR_BYTES, math.ceil(link_gbps * 1e9 / 8 * 1e-3))


def _tbf(link_gbps: float) -> list[str]:
    rate_bits = round(link_gbps * 1e9)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(tbf_burst_bytes(link_gbps)),
            "latency", f"{TBF_LATENCY_MS}ms"]


def _netem_limit_packets(link_gbps: float, delay_ms: float, mtu: int) -> int:
    # netem holds every packet in flight for the delay: at least twice the bandwidth-delay product, counted in
    # MTU-sized packets (GSO segments are larger, so this over-provisions), never below netem's default of 1000.
    in_flight_bytes = link_gbps * 1e9 / 8 * (delay_ms + TBF_LATENCY_MS) / 1e3
    return max(1000, math.ceil(2 * in_flight_bytes / mtu))


def shaping_commands(
    tc: str, netns: str, device: str, *, link_gbps: float, delay_ms: float, mtu: int
) -> list[list[str]]:
    """The tc commands that (re)shape ``device``'s egress; each replaces what is there (no qdisc, or a blackhole)."""
    base = [tc, "-n", netns, "qdisc", "replace", "dev", device]
    if delay_ms <= 0:
        return [[*base, "root", "handle", "1:", *_tbf(link_gbps)]]
    limit = _netem_limit_packets(link_gbps, delay_ms, mtu)
    return [
        [*base, "root", "handle", "1:", "netem", "delay", f"{delay_ms:g}ms", "limit", str(limit)],
        [*base, "parent", "1:1", "handle", "10:", *_tbf(link_gbps)],
    ]


def blackhole_commands(tc: str, netns: str, device: str) -> list[list[str]]:
    """Drop everything leaving ``device``. No handle: tc refuses to replace handle 1: by a qdisc of another kind."""
    return [[tc, "-n", netns, "qdisc", "replace", "dev", device, "root", "blackhole"]]


def parse_counters(ip_json: str, ports: dict[str, tuple[int, int]]) -> dict[tuple[int, int], LinkCounters]:
    """From ``ip -j -s link show`` in the switch namespace, the counters of each port in ``ports`` (name → (host,
    rail)), keyed the same way."""
    links: list[dict[str, Any]] = json.loads(ip_json)
    found: dict[tuple[int, int], LinkCounters] = {}
    for link in links:
        place = ports.get(str(link.get("ifname", "")))
        if place is None:
            continue
        stats = link.get("stats64") or link["stats"]
        # The switch side's rx is the host's egress, its tx the host's ingress.
        found[place] = LinkCounters(
            host=place[0],
            egress_bytes=int(stats["rx"]["bytes"]),
            ingress_bytes=int(stats["tx"]["bytes"]),
            egress_packets=int(stats["rx"]["packets"]),
            ingress_packets=int(stats["tx"]["packets"]),
            rail=place[1],
        )
    return found
