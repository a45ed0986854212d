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
from collections.abc import Iterator
from typing import Any

import pytest
from weightsync.core.transports.place import RAIL_ADDRS_ENV
from weightsync.testbed import ENV_RAIL_ADDRS, HostProcess, LinkMode, Testbed

from tests.tools.testbed.support import ip, netprobe, read_line, start_or_skip, switch_counters

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


@pytest.fixture(scope="module")
def bed() -> Iterator[Testbed]:
    """Two hosts of two rails each, shared by this module's tests (each leaves every rail up)."""
    with start_or_skip(Testbed(2, link_gbps=LINK_GBPS, rails=2)) as testbed:
        yield testbed


def test_each_rail_is_a_network_of_its_own_shaped_counted_and_cut_alone(bed: Testbed) -> None:
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


def test_a_worker_in_a_host_finds_its_rail_from_its_local_rank(bed: Testbed) -> None:
    """What a weightsync worker started in a host of a two-rail testbed reports: the host's environment gives the
    rail addresses, ``LOCAL_RANK`` picks one."""
    script = ("import json; from weightsync.core.transports.place import ping_answer; "
              "print(json.dumps(ping_answer(node_id='n', host_ip='198.18.0.2')))")
    for local_rank in (0, 1, 2):
        env = {**os.environ, "LOCAL_RANK": str(local_rank)}
        answer = json.loads(bed.run(1, [sys.executable, "-c", script], env=env, timeout=60).stdout)
        rail = local_rank % 2
        assert (answer["rail"], answer["rail_address"], answer["rails"]) == (rail, f"198.18.{rail}.2", 2)


PROBER = """
import json, socket, sys, time
from weightsync.core.transports.place import reaches
for line in sys.stdin:
    how, address, timeout = line.split()
    started = time.monotonic()
    if how == "reaches":
        answer = {"reached": reaches(address, timeout=float(timeout))}
    else:  # one bare connection, as the probe made before it tried again
        try:
            socket.create_connection((address, 9), timeout=float(timeout)).close()
            answer = {"reached": True}
        except ConnectionRefusedError:
            answer = {"reached": True}
        except OSError as error:
            answer = {"reached": False, "error": error.strerror or type(error).__name__}
    print(json.dumps({**answer, "seconds": time.monotonic() - started}), flush=True)
"""


def _neighbour_states(bed: Testbed, host: int, address: str) -> list[str]:
    """The kernel's neighbour entry for ``address`` in ``host`` (read with ``ip``, outside weightsync)."""
    entries = json.loads(ip("-n", bed.hosts[host].netns, "-j", "neigh", "show", address) or "[]")
    return [state for entry in entries for state in entry.get("state", [])]


def test_a_probe_reaches_a_rail_back_up_whose_neighbour_resolution_fails_after_it(bed: Testbed) -> None:
    """Host 0's rail 1 cut (carrier lost) while a connection from host 0 resolves host 1's rail address (a rollout
    worker's host, probing the sender's rail as ``control.rails`` has it do), and up again before that resolution
    ends: it ends failed, and the first connection after the cut fails with "no route to host" (the negative
    control: the kernel's trap, which made the rail-fault test flaky on a loaded machine). Weightsync's probe
    (``reaches``, what a worker answers a ``probe`` ping with) still reports the rail reached. One ARP request per
    resolution in host 0 (``mcast_solicit=1``) makes the trap land every time; by default it lands when the link
    comes back during a resolution's last request."""
    address, device = bed.hosts[1].rails[1].address, bed.hosts[0].rails[1].device
    solicit = [f"net.ipv4.neigh.{device}.{key}" for key in ("mcast_solicit", "ucast_solicit")]
    defaults = [_shell(bed, 0, f"sysctl -n {key}").strip() for key in solicit]
    _shell(bed, 0, f"sysctl -qw {solicit[0]}=1 {solicit[1]}=0")
    prober = bed.popen(0, [sys.executable, "-c", PROBER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def probe(how: str, timeout: float = 1.0) -> dict[str, Any]:
        assert prober.stdin is not None
        prober.stdin.write(f"{how} {address} {timeout}\n".encode())
        prober.stdin.flush()
        answer: dict[str, Any] = json.loads(read_line(prober, 30))
        return answer

    try:
        assert probe("reaches")["reached"]
        for how in ("bare", "reaches"):
            bed.link_down(0, rail=1, mode="carrier")
            try:
                assert not probe("bare", 0.2)["reached"]  # its ARP request is lost: the resolution waits a second
                assert _neighbour_states(bed, 0, address) == ["INCOMPLETE"]
            finally:
                bed.link_up(0, rail=1)
            answer = probe(how)
            if how == "bare":
                assert not answer["reached"] and answer["error"] == "No route to host", answer
            else:
                assert answer["reached"] and answer["seconds"] < 1.0 + 0.5, answer
    finally:
        prober.kill()
        prober.wait(10)
        _shell(bed, 0, " ".join(["sysctl -qw", *(f"{key}={value}" for key, value in zip(solicit, defaults))]))
