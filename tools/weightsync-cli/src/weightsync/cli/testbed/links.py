"""Each host's link: how it is shaped, how it goes down and up, and how its bytes are counted.

A host's link is one veth pair: ``eth0`` in the host's namespace, its peer ``wst-h<i>`` in the switch namespace,
enslaved to the switch's bridge. Shaping is ``tc`` on the egress of each end, so each direction has its own
bottleneck:

- host → switch (the host's egress): a qdisc on the host's ``eth0``;
- switch → host (the host's ingress): a qdisc on the switch-side ``wst-h<i>``.

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

Counters are read outside every host, from the switch-side veth: what it received is what the host sent, what it
transmitted is what reached the host (after the ingress shaper, so dropped frames do not count). No process inside
a host can change them, which is what makes them evidence that bytes crossed the link.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["LinkCounters", "LinkMode", "blackhole_commands", "parse_counters", "shaping_commands", "tbf_burst_bytes"]

LinkMode = Literal["drop", "carrier"]

BURST_FLOOR_BYTES = 256 * 1024
TBF_LATENCY_MS = 20


@dataclass(frozen=True)
class LinkCounters:
    """Bytes and packets on one host's link, read from the switch side; subtract two readings for a delta.

    ``egress_*``: host → switch (sent by the host); ``ingress_*``: switch → host (received by the host). Bytes are
    whole Ethernet frames (headers included), as the kernel counts them.
    """

    host: int
    egress_bytes: int
    ingress_bytes: int
    egress_packets: int
    ingress_packets: int

    def __sub__(self, earlier: LinkCounters) -> LinkCounters:
        if earlier.host != self.host:
            raise ValueError(f"counters of host {self.host} minus counters of host {earlier.host}")
        return LinkCounters(
            host=self.host,
            egress_bytes=self.egress_bytes - earlier.egress_bytes,
            ingress_bytes=self.ingress_bytes - earlier.ingress_bytes,
            egress_packets=self.egress_packets - earlier.egress_packets,
            ingress_packets=self.ingress_packets - earlier.ingress_packets,
        )


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


def parse_counters(ip_json: str, ports: dict[str, int]) -> dict[int, LinkCounters]:
    """From ``ip -j -s link show`` in the switch namespace, the counters of each port in ``ports`` (name → host)."""
    links: list[dict[str, Any]] = json.loads(ip_json)
    found: dict[int, LinkCounters] = {}
    for link in links:
        host = ports.get(str(link.get("ifname", "")))
        if host is None:
            continue
        stats = link.get("stats64") or link["stats"]
        # The switch side's rx is the host's egress, its tx the host's ingress.
        found[host] = LinkCounters(
            host=host,
            egress_bytes=int(stats["rx"]["bytes"]),
            ingress_bytes=int(stats["tx"]["bytes"]),
            egress_packets=int(stats["rx"]["packets"]),
            ingress_packets=int(stats["tx"]["packets"]),
        )
    return found
