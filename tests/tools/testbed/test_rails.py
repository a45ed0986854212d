"""Rails (``Testbed(rails=K)``): K links per host, each its own shaped network, counted and cut one by one.

Traffic is addressed to a host's rail-k address and counted from outside (``ip`` on the switch-side ports, not the
testbed's code); the rates are liveness bands, not measurements.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time

from weightsync.core.transports.place import RAIL_ADDRS_ENV
from weightsync.testbed import ENV_RAIL_ADDRS, HostProcess, LinkMode, Testbed

from tests.tools.testbed.support import netprobe, read_line, start_or_skip, switch_counters

LINK_GBPS = 0.5
COUNT = 40 * 1024 * 1024  # ~0.7 s at 0.5 Gb/s
PORT = 5301


def _shell(bed: Testbed, host: int, script: str) -> str:
    return bed.run(host, ["sh", "-c", script], timeout=30).stdout.decode()


def _sinks(bed: Testbed, addresses: list[str]) -> list[HostProcess]:
    sinks = [bed.popen(1, netprobe("sink", address, PORT + k, 60), stdout=subprocess.PIPE)
             for k, address in enumerate(addresses)]
    for sink in sinks:
        assert read_line(sink, 20) == "listening"
    return sinks


def test_each_rail_is_a_network_of_its_own_shaped_counted_and_cut_alone() -> None:
    with start_or_skip(Testbed(2, link_gbps=LINK_GBPS, rails=2)) as bed:
        rails = bed.hosts[1].rails
        assert [rail.address for rail in rails] == ["198.18.0.2", "198.18.1.2"]
        assert bed.hosts[1].address == rails[0].address and bed.hosts[1].switch_port == rails[0].switch_port
        assert ENV_RAIL_ADDRS == RAIL_ADDRS_ENV  # what weightsync's workers read
        assert _shell(bed, 1, f'echo "${ENV_RAIL_ADDRS}"').strip() == "198.18.0.2,198.18.1.2"
        # Each rail its own subnet and interface; nothing routes out.
        routes = _shell(bed, 0, "ip route show table all | grep -v '^local\\|^broadcast\\|^multicast'")
        assert "default" not in routes
        assert sorted(line.split()[0] for line in routes.splitlines() if line.strip()) == [
            "198.18.0.0/24", "198.18.1.0/24"], routes
        assert all(ipaddress.ip_address(rail.address) in ipaddress.ip_network("198.18.0.0/15") for rail in rails)

        # Both rails at once: each carries its own stream at its own rate, on its own ports only.
        outside, before = switch_counters(bed), bed.rail_counters()
        sinks = _sinks(bed, [rail.address for rail in rails])
        try:
            senders = [bed.popen(0, netprobe("send", rail.address, PORT + k, COUNT), stdout=subprocess.PIPE)
                       for k, rail in enumerate(rails)]
            for sender in senders:
                assert sender.wait(60) == 0
            received = [json.loads(read_line(sink, 30)) for sink in sinks]
        finally:
            for sink in sinks:
                sink.kill()
                sink.wait(10)
        after, outside_after = bed.rail_counters(), switch_counters(bed)
        for k, figures in enumerate(received):
            assert figures["bytes"] == COUNT
            gbps = COUNT * 8 / figures["seconds"] / 1e9
            assert 0.5 * LINK_GBPS <= gbps <= 1.1 * LINK_GBPS, (k, gbps)  # each at its link's rate, together
        for k, rail in enumerate(bed.hosts[0].rails):
            sent = outside_after[rail.switch_port][0] - outside[rail.switch_port][0]
            assert 0.95 * COUNT <= sent <= 1.1 * COUNT, (k, sent)  # one stream each, counted on its own rail
            assert abs((after[0][k] - before[0][k]).egress_bytes - sent) < 64 * 1024
        totals = bed.counters()
        assert totals[0].rail == -1 and totals[0].egress_bytes == sum(c.egress_bytes for c in bed.rail_counters()[0])

        # One rail cut: the other still connects; the cut one does not, until it is up again.
        modes: tuple[LinkMode, ...] = ("drop", "carrier")
        for mode in modes:
            sinks = _sinks(bed, [rail.address for rail in rails])
            try:
                bed.link_down(1, rail=1, mode=mode)
                assert not bed.link_is_up(1) and not bed.link_is_up(1, rail=1) and bed.link_is_up(1, rail=0)
                assert bed.run(0, netprobe("connect", rails[0].address, PORT, 5), timeout=30).returncode == 0
                started = time.monotonic()
                assert bed.run(0, netprobe("connect", rails[1].address, PORT + 1, 1), timeout=30,
                               check=False).returncode == 3, mode
                assert time.monotonic() - started < 10
                bed.link_up(1, rail=1)
                assert bed.link_is_up(1)
                assert bed.run(0, netprobe("connect", rails[1].address, PORT + 1, 5), timeout=30).returncode == 0
            finally:
                bed.link_up(1)
                for sink in sinks:
                    sink.kill()
                    sink.wait(10)
        # Every rail of a host at once (the default): the host is cut off.
        bed.link_down(1)
        assert not bed.link_is_up(1, rail=0) and not bed.link_is_up(1, rail=1)
        bed.link_up(1)
        assert bed.link_is_up(1)


def test_a_worker_in_a_host_finds_its_rail_from_its_local_rank() -> None:
    """What a weightsync worker started in a host of a two-rail testbed reports: the host's environment gives the
    rail addresses, ``LOCAL_RANK`` picks one."""
    script = ("import json; from weightsync.core.transports.place import ping_answer; "
              "print(json.dumps(ping_answer(node_id='n', host_ip='198.18.0.2')))")
    with start_or_skip(Testbed(2, link_gbps=LINK_GBPS, rails=2)) as bed:
        for local_rank in (0, 1, 2):
            env = {**os.environ, "LOCAL_RANK": str(local_rank)}
            answer = json.loads(bed.run(1, [sys.executable, "-c", script], env=env, timeout=60).stdout)
            rail = local_rank % 2
            assert (answer["rail"], answer["rail_address"], answer["rails"]) == (rail, f"198.18.{rail}.2", 2)
