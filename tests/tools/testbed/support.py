"""Helpers for tests that need the emulated multi-host testbed (this folder's and, later, bench and fault tests).

``start_or_skip(Testbed(...))`` starts a testbed or skips the test with the machine's one-line reason
(``skip_unless_testbed()`` only checks); with
``WEIGHTSYNC_REQUIRE_TESTBED=1`` (CI) an unbuildable testbed fails the test instead. Also: reading the machine's
own interfaces, routes and namespaces from outside the code under test.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import pytest
from weightsync.testbed import REQUIRE_ENV, Testbed, TestbedUnavailable, testbed_required, unavailable_reason

NETPROBE = str(pathlib.Path(__file__).with_name("netprobe.py"))


def start_or_skip(testbed: Testbed) -> Testbed:
    """``testbed.start()``; skip (or, where the testbed is required, fail) if this machine cannot host it."""
    try:
        return testbed.start()
    except TestbedUnavailable as error:
        unavailable(error.reason)


def skip_unless_testbed() -> None:
    """Skip (or, where the testbed is required, fail) unless this machine can host a testbed."""
    reason = unavailable_reason()
    if reason is not None:
        unavailable(reason)


def unavailable(reason: str) -> NoReturn:
    if testbed_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but no testbed can be built here: {reason}")
    pytest.skip(f"no multi-host testbed on this machine: {reason}")


def netprobe(*args: object) -> list[str]:
    """argv running netprobe.py with this interpreter."""
    return [sys.executable, NETPROBE, *(str(arg) for arg in args)]


def ip(*args: str) -> str:
    """``ip ARGS`` on the machine (outside every testbed namespace unless ``-n`` says otherwise)."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=True).stdout


def netns_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def netns_pids(netns: str) -> set[int]:
    done = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=15, check=False)
    return {int(token) for token in done.stdout.split()}


def machine_network() -> tuple[list[str], str, str]:
    """The machine's own interfaces (name, index, address, state), IPv4 and IPv6 routes."""
    links = [f"{link['ifindex']} {link['ifname']} {link.get('address', '')} {link.get('operstate', '')}"
             for link in json.loads(ip("-j", "link", "show"))]
    return links, ip("route", "show", "table", "all"), ip("-6", "route", "show", "table", "all")


def switch_counters(testbed: Testbed) -> dict[str, tuple[int, int]]:
    """Each switch port's (rx bytes, tx bytes), read with ``ip`` directly, not through the testbed's code."""
    links = json.loads(ip("-n", testbed.switch_netns, "-j", "-s", "link", "show"))
    return {link["ifname"]: (link["stats64"]["rx"]["bytes"], link["stats64"]["tx"]["bytes"]) for link in links}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    return text[text.rfind(b")") + 2:][:1] not in (b"Z", b"X")


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    """Poll ``condition`` every 20 ms for at most ``timeout`` s; its last value."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of ``process``'s stdout within ``timeout`` s (a reader thread keeps the wait bounded)."""
    if process.stdout is None:
        raise ValueError("process has no stdout pipe")
    stdout = process.stdout
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines:
        raise TimeoutError(f"no line from {process.args!r} within {timeout:g} s")
    return lines[0].decode().strip()
