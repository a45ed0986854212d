"""The links: a TCP transfer between two hosts runs at the link's rate, the links' own counters see its bytes, a
link taken down stops traffic within a bound and comes back up.

Rates are checked in a generous band (0.5-1.1 × the link): the machine is shared and these are liveness checks of
the shaping, not measurements. Counters are read with ``ip`` directly, outside the code under test, and compared
with what the testbed reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from weightsync.testbed import LinkCounters, Testbed, TestbedUnavailable, probe, tbf_burst_bytes

from tests.tools.testbed.conftest import LINK_GBPS
from tests.tools.testbed.support import netprobe, read_line, start_or_skip, switch_counters

TRANSFER_BYTES = 96 * 1024 * 1024  # ~0.8 s at 1 Gb/s
PORT = 5201


def transfer(testbed: Testbed, sender: int, receiver: int, port: int, count: int) -> dict[str, float]:
    """Send ``count`` bytes from host ``sender`` to host ``receiver``; the receiver's figures (bytes, seconds)."""
    address = testbed.hosts[receiver].address
    sink = testbed.popen(receiver, netprobe("sink", address, port, 60), stdout=subprocess.PIPE)
    try:
        assert read_line(sink, 20) == "listening"
        sent = testbed.run(sender, netprobe("send", address, port, count), timeout=60)
        assert json.loads(sent.stdout)["bytes"] == count
        received: dict[str, float] = json.loads(read_line(sink, 30))
    finally:
        sink.kill()
        sink.wait(10)
    return received


def test_tcp_transfer_runs_at_the_link_rate_and_the_links_count_its_bytes(testbed: Testbed) -> None:
    ports = {entry.switch_port: entry.index for entry in testbed.hosts}
    before_outside, before = switch_counters(testbed), testbed.counters()
    received = transfer(testbed, 0, 1, PORT, TRANSFER_BYTES)
    after_outside, after = switch_counters(testbed), testbed.counters()

    assert received["bytes"] == TRANSFER_BYTES
    gbps = received["bytes"] * 8 / received["seconds"] / 1e9
    assert 0.5 * LINK_GBPS <= gbps <= 1.1 * LINK_GBPS, f"{gbps:.3f} Gb/s over a {LINK_GBPS} Gb/s link"

    # From outside: the switch side of host 0's veth received (host 0's egress), host 1's transmitted (ingress).
    delta = {ports[name]: (after_outside[name][0] - before_outside[name][0],
                           after_outside[name][1] - before_outside[name][1]) for name in ports}
    assert delta[0][0] >= 0.95 * TRANSFER_BYTES
    assert delta[1][1] >= 0.95 * TRANSFER_BYTES
    assert delta[0][0] <= 1.1 * TRANSFER_BYTES  # headers, not a second copy
    # The switch forwards by address: host 2's link carries next to nothing of it.
    assert delta[2][1] < 0.01 * TRANSFER_BYTES
    # The testbed's own reading agrees (within the ARP/ACK chatter between the two reads).
    for host in range(3):
        reported = after[host] - before[host]
        assert abs(reported.egress_bytes - delta[host][0]) < 64 * 1024
        assert abs(reported.ingress_bytes - delta[host][1]) < 64 * 1024


def test_both_directions_of_every_link_are_shaped_as_specified(testbed: Testbed) -> None:
    """tbf rate X, burst max(256KiB, 1 ms × X), latency 20ms: on each host's eth0 and on its switch port."""
    for entry in testbed.hosts:
        for netns, device in ((entry.netns, "eth0"), (testbed.switch_netns, entry.switch_port)):
            qdiscs = json.loads(subprocess.run(["tc", "-n", netns, "-j", "qdisc", "show", "dev", device],
                                               capture_output=True, text=True, timeout=15, check=True).stdout)
            tbf = [qdisc for qdisc in qdiscs if qdisc["kind"] == "tbf"]
            assert len(tbf) == 1, qdiscs
            options = tbf[0]["options"]
            assert options["rate"] == LINK_GBPS * 1e9 / 8
            # tc reports the burst after its own rounding to the kernel's time units.
            assert abs(options["burst"] - tbf_burst_bytes(LINK_GBPS)) <= 64
            assert options["lat"] == 20_000
    assert tbf_burst_bytes(1.0) == 256 * 1024 and tbf_burst_bytes(10.0) == 1_250_000


@pytest.mark.parametrize("mode", ["drop", "carrier"])
def test_link_down_stops_traffic_within_a_bound_and_link_up_restores_it(testbed: Testbed, mode: str) -> None:
    port = PORT + 1 + ["drop", "carrier"].index(mode)
    address = testbed.hosts[1].address
    sink = testbed.popen(1, netprobe("sink", address, port, 60), stdout=subprocess.PIPE)
    stream = None
    try:
        assert read_line(sink, 20) == "listening"
        assert testbed.run(0, netprobe("connect", address, port, 5), timeout=30, check=False).returncode == 0
        stream = testbed.popen(0, netprobe("stream", address, port, 30), stdout=subprocess.PIPE)
        assert read_line(stream, 20) == "streaming"

        down_at = time.monotonic()
        testbed.link_down(1, mode="drop" if mode == "drop" else "carrier")
        assert not testbed.link_is_up(1)
        # A transfer in flight stalls: the sender's 1 s send timeout fires once its buffers are full.
        outcome = json.loads(read_line(stream, 15))
        assert outcome["stalled"] is True
        assert time.monotonic() - down_at < 10
        # A new connection cannot open.
        started = time.monotonic()
        assert testbed.run(0, netprobe("connect", address, port, 1), timeout=30, check=False).returncode == 3
        assert time.monotonic() - started < 10

        testbed.link_up(1)
        assert testbed.link_is_up(1)
        assert testbed.run(0, netprobe("connect", address, port, 5), timeout=30, check=False).returncode == 0
        assert testbed.run(0, netprobe("send", address, port, 4 * 1024 * 1024), timeout=30).returncode == 0
    finally:
        testbed.link_up(1)
        for process in (stream, sink):
            if process is not None:
                process.kill()
                process.wait(10)


def test_link_counters_subtract_per_host() -> None:
    earlier = LinkCounters(host=1, egress_bytes=10, ingress_bytes=20, egress_packets=1, ingress_packets=2)
    later = LinkCounters(host=1, egress_bytes=15, ingress_bytes=50, egress_packets=2, ingress_packets=5)
    assert later - earlier == LinkCounters(host=1, egress_bytes=5, ingress_bytes=30, egress_packets=1,
                                           ingress_packets=3)
    with pytest.raises(ValueError, match="host 2"):
        later - LinkCounters(host=2, egress_bytes=0, ingress_bytes=0, egress_packets=0, ingress_packets=0)


def test_rtt_delays_every_round_trip_or_is_unavailable_without_netem() -> None:
    """An RTT needs sch_netem: where the kernel has it, a TCP handshake takes at least the RTT; else a clear no."""
    rtt_ms = 40.0
    bed = Testbed(2, link_gbps=LINK_GBPS, rtt_ms=rtt_ms)
    if probe().reason is None and not probe().netem:
        with pytest.raises(TestbedUnavailable, match="sch_netem"):
            bed.start()
        assert not bed.started
        pytest.skip("this kernel has no sch_netem: RTTs are unavailable here (and say so)")
    with start_or_skip(bed):
        address = bed.hosts[1].address
        sink = bed.popen(1, netprobe("sink", address, PORT, 30), stdout=subprocess.PIPE)
        try:
            assert read_line(sink, 20) == "listening"
            script = ("import socket,sys,time; t=time.perf_counter(); "
                      f"socket.create_connection(('{address}', {PORT}), timeout=5).close(); "
                      "print(time.perf_counter()-t)")
            seconds = [float(bed.run(0, [sys.executable, "-c", script],
                                     timeout=30).stdout) for _ in range(3)]
        finally:
            sink.kill()
            sink.wait(10)
        assert min(seconds) >= 0.9 * rtt_ms / 1e3, seconds
        assert min(seconds) < 10 * rtt_ms / 1e3, seconds
