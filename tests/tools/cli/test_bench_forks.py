"""The bench's fork server (``weightsync.cli.bench.forks``), run on this machine as a testbed host runs it: a process
whose stdin is its control socket. Its workers are checked from outside: their parent pid and liveness read from
``/proc``, not from the server's replies."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from weightsync.cli.bench.forks import FORK_SERVER_ARGV, ForkServerError, HostForks

from tests.tools.testbed.support import wait_until

SPEC = {"layout": [["w", [8]]], "role": "rollout", "rank": 0, "kind": "naive", "node_id": "node", "testbed": False}


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name (state, parent pid, ...); [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return []


def _parent(pid: int) -> int:
    return int(_stat(pid)[1])


def _zombie(pid: int) -> bool:
    """Exited, not reaped (its server is gone: it waits for init)."""
    return _stat(pid)[:1] == ["Z"]


def _gone(pid: int) -> bool:
    """Exited and reaped (a zombie still has its /proc entry, in state Z)."""
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def server() -> Iterator[tuple[HostForks, subprocess.Popen[bytes]]]:
    ours, theirs = HostForks.pair()
    process = subprocess.Popen(FORK_SERVER_ARGV, stdin=theirs.fileno())
    theirs.close()
    forks = HostForks(ours)
    try:
        yield forks, process
    finally:
        forks.close()
        try:
            process.wait(30)
        finally:
            process.kill()


def test_forked_workers_answer_are_reaped_and_killed_when_they_hang(
        server: tuple[HostForks, subprocess.Popen[bytes]]) -> None:
    forks, process = server
    channel, pid = forks.fork()
    assert _parent(pid) == process.pid  # forked by the server, not started by the driver
    channel.send_bytes(json.dumps(SPEC).encode())
    for command in ({"op": "mark"}, {"op": "rss"}, {"op": "close"}):
        channel.send_bytes(json.dumps(command).encode())
        reply = json.loads(channel.recv_bytes())
    assert reply is None  # close's answer
    assert forks.reap(pid, 30.0) is False and _gone(pid)  # it exited by itself
    channel.close()

    # A worker that never gets its spec hangs: reap kills it once the timeout has passed.
    hung, hung_pid = forks.fork()
    started = time.monotonic()
    assert forks.reap(hung_pid, 0.5) is True and _gone(hung_pid)
    assert time.monotonic() - started >= 0.5
    hung.close()


def test_closing_the_control_socket_ends_the_server_and_its_workers(
        server: tuple[HostForks, subprocess.Popen[bytes]]) -> None:
    forks, process = server
    channel, pid = forks.fork()
    assert not _gone(pid)
    forks.close()
    assert process.wait(30) == 0
    assert wait_until(lambda: _gone(pid), timeout=10)  # killed by the server as it exits
    channel.close()
    with pytest.raises(ForkServerError, match="gone"):
        forks.fork()  # its end is closed
    ours, theirs = HostForks.pair()
    theirs.close()  # a server that died before it started
    with pytest.raises(ForkServerError, match="gone"):
        HostForks(ours).fork()
    ours.close()


def test_a_killed_server_is_seen_gone_though_its_workers_live(server: tuple[HostForks, subprocess.Popen[bytes]]
                                                             ) -> None:
    """Its workers hold no copy of its end of the control socket, so its end closes with it: the driver's next
    request fails at once instead of waiting for an answer that never comes."""
    forks, process = server
    channel, pid = forks.fork()
    process.kill()
    process.wait(30)
    assert not _gone(pid)  # the worker lives on, waiting for its spec
    started = time.monotonic()
    with pytest.raises(ForkServerError, match="gone"):
        forks.fork()
    assert time.monotonic() - started < 10
    channel.close()  # its driver went away: the worker ends
    assert wait_until(lambda: _gone(pid) or _zombie(pid), timeout=10)
