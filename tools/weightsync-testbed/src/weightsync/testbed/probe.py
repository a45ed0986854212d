"""Can this machine host a testbed? A real, throwaway build answers, once per process.

Checking for root and for the tools is not enough: a container may be root without CAP_SYS_ADMIN, a kernel may
lack veth, bridges or tbf, a mount namespace may refuse tmpfs. So the probe builds the smallest testbed that uses
every one of those (a network namespace with a veth pair, a bridge, a tbf and a blackhole qdisc, one namespace
holder) and removes it. Any failure there makes the testbed *unavailable* (TestbedUnavailable, tests skip); a
failure in a real build after a passing probe is a TestbedError (tests fail). The probe also finds out whether the
kernel has sch_netem, which only an RTT needs.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

from weightsync.testbed.cleanup import CleanupReport, remove_run
from weightsync.testbed.holder import start_holder, wait_ready
from weightsync.testbed.links import blackhole_commands, shaping_commands
from weightsync.testbed.system import RunName, TestbedError, Tools, command, find_tools

__all__ = ["REQUIRE_ENV", "Capabilities", "probe", "testbed_required", "unavailable_reason"]

# Set to 1 where a testbed must be buildable (CI): tests then fail instead of skipping.
REQUIRE_ENV = "WEIGHTSYNC_REQUIRE_TESTBED"
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Capabilities:
    """``reason`` is None where a testbed can be built (else one line saying why not); ``netem``: RTTs possible."""

    reason: str | None
    netem: bool
    tools: Tools | None


def testbed_required() -> bool:
    """Whether ``WEIGHTSYNC_REQUIRE_TESTBED=1`` (CI): an unbuildable testbed is then a failure, not a skip."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def unavailable_reason() -> str | None:
    """None where this machine can host a testbed, else one line saying why it cannot."""
    return probe().reason


@functools.cache
def probe() -> Capabilities:
    """Probe once per process (a fraction of a second); see the module docstring."""
    if not sys.platform.startswith("linux"):
        return Capabilities(f"the testbed needs Linux namespaces (this is {sys.platform})", False, None)
    if os.geteuid() != 0:
        return Capabilities(f"the testbed needs root (euid {os.geteuid()})", False, None)
    tools = find_tools()
    if isinstance(tools, str):
        return Capabilities(tools, False, None)
    run = RunName.new()
    netns = run.probe_netns
    try:
        command([tools.ip, "netns", "add", netns], timeout=PROBE_TIMEOUT_S, what="creating a network namespace")
    except TestbedError as error:
        return Capabilities(str(error), False, tools)
    try:
        return Capabilities(_probe_in(tools, netns), _has_netem(tools, netns), tools)
    finally:
        remove_run(tools, run, [netns], timeout=PROBE_TIMEOUT_S, report=CleanupReport())


def _probe_in(tools: Tools, netns: str) -> str | None:
    steps: list[tuple[str, list[str]]] = [
        ("creating a veth pair", [tools.ip, "-n", netns, "link", "add", "wst-a", "type", "veth", "peer", "wst-b"]),
        ("creating a bridge", [tools.ip, "-n", netns, "link", "add", "wst-br", "type", "bridge"]),
        ("tc tbf", shaping_commands(tools.tc, netns, "wst-a", link_gbps=1.0, delay_ms=0, mtu=1500)[0]),
        ("tc blackhole", blackhole_commands(tools.tc, netns, "wst-b")[0]),
    ]
    try:
        for what, argv in steps:
            command(argv, timeout=PROBE_TIMEOUT_S, what=what)
        process = start_holder(tools, netns, hostname="wst-probe", hosts_file="", shm_bytes=1 << 20, lifetime_s=30)
        try:
            wait_ready(process, what="probe host", deadline=time.monotonic() + PROBE_TIMEOUT_S)
        finally:
            if process.stdin is not None:
                process.stdin.close()  # the holder exits on EOF; remove_run kills whatever is left in the netns
            process.kill()
            process.wait(timeout=PROBE_TIMEOUT_S)
    except (TestbedError, OSError) as error:
        return str(error)
    return None


def _has_netem(tools: Tools, netns: str) -> bool:
    argv = shaping_commands(tools.tc, netns, "wst-a", link_gbps=1.0, delay_ms=1.0, mtu=1500)[0]
    try:
        command(argv, timeout=PROBE_TIMEOUT_S)
    except TestbedError:
        return False
    return True
