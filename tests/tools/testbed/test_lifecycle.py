"""Nothing outlives a testbed: teardown on exit, on error, on Ctrl-C/SIGTERM/SIGHUP; after a ``kill -9`` the
holders take the hosts' processes with them and ``cleanup()`` removes the rest (and without it, it stays: the
negative control). Where the testbed cannot be built, a typed error with the reason, and a skip or, in CI, a fail.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from weightsync.testbed import (
    REQUIRE_ENV,
    Capabilities,
    Testbed,
    TestbedError,
    TestbedUnavailable,
    cleanup,
    probe,
)
from weightsync.testbed import bed as bed_module
from weightsync.testbed import holder as holder_module
from weightsync.testbed import links as links_module
from weightsync.testbed.cleanup import run_folder
from weightsync.testbed.holder import Holder

from tests.tools.testbed.support import (
    alive,
    machine_network,
    netns_names,
    netns_pids,
    read_line,
    skip_unless_testbed,
    start_or_skip,
    wait_until,
)

OWNER = str(pathlib.Path(__file__).with_name("owner.py"))


@pytest.fixture
def needs_testbed() -> None:
    """Skip (or, in CI, fail) where this machine cannot host a testbed."""
    skip_unless_testbed()


def run_processes(testbed: Testbed) -> set[int]:
    return set().union(*(netns_pids(name) for name in [testbed.switch_netns, *(h.netns for h in testbed.hosts)]))


def assert_gone(run: str, netns: list[str], pids: set[int]) -> None:
    assert not any(name.startswith(run) for name in netns_names()), netns_names()
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10), [pid for pid in pids if alive(pid)]
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), run))


def test_teardown_removes_namespaces_links_and_every_process(needs_testbed: None) -> None:
    network = machine_network()
    with Testbed(2, link_gbps=1.0) as testbed:
        sleeper = testbed.popen(1, ["sleep", "600"])
        # A daemon in a session of its own: out of reach of sleeper's process group, not of its host's pid 1.
        testbed.run(0, ["sh", "-c", "setsid sleep 600 > /dev/null 2>&1 < /dev/null &"], timeout=30)
        pids = run_processes(testbed)
        netns = [testbed.switch_netns, *(h.netns for h in testbed.hosts)]
        assert set(netns) <= netns_names()
        assert len(pids) >= 5  # two holders, nsenter and sleep, the daemon
        assert all("wst-" not in link for link in machine_network()[0])
    assert_gone(testbed.run_name.name, netns, pids)
    assert sleeper.returncode is not None
    assert machine_network() == network
    testbed.close()  # idempotent
    with pytest.raises(TestbedError, match="closed"):
        testbed.popen(0, ["true"])


def test_an_error_in_the_block_still_removes_everything(needs_testbed: None) -> None:
    testbed = Testbed(2, link_gbps=1.0)
    with pytest.raises(ZeroDivisionError), testbed:
        testbed.popen(1, ["sleep", "600"])
        pids = run_processes(testbed)
        1 / 0  # noqa: B018
    assert_gone(testbed.run_name.name, [], pids)


@pytest.fixture
def owner_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def start_owner(mode: str, started: list[subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    process = subprocess.Popen([sys.executable, OWNER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started.append(process)
    line = read_line(process, 60)
    if not line and process.wait(10) is not None:
        stderr = process.stderr.read().decode() if process.stderr else ""
        if "TestbedUnavailable" in stderr:
            pytest.skip(stderr.strip().splitlines()[-1])
        pytest.fail(stderr)
    info: dict[str, str] = json.loads(line)
    return process, info


@pytest.mark.parametrize(("mode", "signum", "returncode"), [
    ("with", signal.SIGINT, -signal.SIGINT),  # KeyboardInterrupt, re-raised as the signal by Python at exit
    ("with", signal.SIGHUP, 128 + signal.SIGHUP),
    ("start", signal.SIGTERM, 128 + signal.SIGTERM),  # no with block: the handler's SystemExit, then atexit
])
def test_a_signalled_owner_removes_its_testbed(needs_testbed: None, owner_processes: list[subprocess.Popen[bytes]],
                                               mode: str, signum: int, returncode: int) -> None:
    process, info = start_owner(mode, owner_processes)
    pids = set().union(*(netns_pids(name) for name in info["netns"]))
    assert len(pids) >= 5
    process.send_signal(signum)
    assert process.wait(30) == returncode
    assert_gone(info["run"], list(info["netns"]), pids)


def test_a_killed_runs_leftovers_stay_until_cleanup_removes_them(
    testbed_live: Testbed, owner_processes: list[subprocess.Popen[bytes]]
) -> None:
    process, info = start_owner("with", owner_processes)
    pids = set().union(*(netns_pids(name) for name in info["netns"]))
    process.kill()
    process.wait(10)
    # The holders see their owner go and take every process of their hosts with them...
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10), [pid for pid in pids if alive(pid)]
    # ...but the named namespaces stay (the negative control: without cleanup they are there).
    assert set(info["netns"]) <= netns_names()
    assert os.path.isdir(os.path.join(tempfile.gettempdir(), info["run"]))

    report = cleanup()
    assert set(info["netns"]) <= set(report.removed_netns)
    assert_gone(info["run"], list(info["netns"]), pids)
    # A testbed whose owner (this process) is alive is left alone, and still works.
    assert testbed_live.run_name.name in report.live_runs
    assert {h.netns for h in testbed_live.hosts} <= netns_names()
    assert testbed_live.run(1, ["hostname"], timeout=30).stdout.decode().strip() == "wst-h1"
    assert not cleanup().removed_anything


@pytest.fixture
def testbed_live() -> Iterator[Testbed]:
    """A 2-host testbed of this test's own (its owner, this process, is alive)."""
    with start_or_skip(Testbed(2, link_gbps=1.0)) as testbed:
        yield testbed


def test_unavailable_machine_raises_a_typed_one_line_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = probe.__wrapped__().reason  # the uncached probe, as a non-root user would see it
    assert reason == "the testbed needs root (euid 1000)"

    monkeypatch.setattr(bed_module, "probe", lambda: Capabilities("no network namespaces here", False, None))
    testbed = Testbed(2, link_gbps=1.0)
    with pytest.raises(TestbedUnavailable, match="no network namespaces here") as raised:
        testbed.start()
    assert raised.value.reason == "no network namespaces here" and "\n" not in raised.value.reason
    assert not testbed.started

    # Tests skip with that reason, except where the testbed is required (CI), where they fail.
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no network namespaces here"):
        start_or_skip(Testbed(2, link_gbps=1.0))
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no network namespaces here"):
        start_or_skip(Testbed(2, link_gbps=1.0))


@pytest.mark.parametrize("kwargs", [{"hosts": 0}, {"hosts": 251}, {"link_gbps": 0.0}, {"rtt_ms": -1.0},
                                    {"mtu": 100}, {"lifetime_s": 0.0}, {"shm_bytes": 0}])
def test_bad_arguments_raise_at_the_call(kwargs: dict[str, float]) -> None:
    arguments: dict[str, float] = {"hosts": 2, "link_gbps": 1.0, **kwargs}
    hosts = int(arguments.pop("hosts"))
    with pytest.raises(ValueError):
        Testbed(hosts, **arguments)  # type: ignore[arg-type]


def test_host_processes_take_signals_as_local_ones_do(testbed_live: Testbed) -> None:
    """terminate() reaches the program (nsenter would not pass it on) and its exit status comes back; kill() kills."""
    handles_term = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); "
                    "print('up', flush=True); time.sleep(60)")
    graceful = testbed_live.popen(1, [sys.executable, "-c", handles_term], stdout=subprocess.PIPE)
    assert read_line(graceful, 20) == "up"
    graceful.terminate()
    assert graceful.wait(10) == 7
    ignores_term = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                    "time.sleep(60)")
    stubborn = testbed_live.popen(1, [sys.executable, "-c", ignores_term], stdout=subprocess.PIPE)
    assert read_line(stubborn, 20) == "up"
    stubborn.kill()
    assert stubborn.wait(10) == -signal.SIGKILL
    plain = testbed_live.popen(0, ["sleep", "600"])
    plain.terminate()
    assert plain.wait(10) == -signal.SIGTERM
    with pytest.raises(subprocess.CalledProcessError):
        testbed_live.run(0, ["sh", "-c", "exit 4"], timeout=30)
    with pytest.raises(subprocess.TimeoutExpired):
        testbed_live.run(0, ["sleep", "600"], timeout=0.5)


@pytest.mark.parametrize("step", ["shaping", "holder"])
def test_a_build_failing_midway_is_an_error_and_leaves_nothing(
    needs_testbed: None, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    before = netns_names()
    started: list[int] = []  # the holders' processes, seen by the wrapped wait
    if step == "shaping":  # fails before any holder runs
        monkeypatch.setattr(links_module, "shaping_commands",
                            lambda tc, netns, device, **_: [[tc, "-n", netns, "qdisc", "replace", "dev", device,
                                                             "root", "no-such-qdisc"]])
    else:  # host 0's holder is ready, host 1's is running, when host 1's wait fails
        real_wait = holder_module.wait_ready

        def failing_wait(process: subprocess.Popen[bytes], *, what: str, deadline: float) -> Holder:
            started.append(process.pid)
            if what == "host 1":
                assert wait_until(lambda: bool(children(process.pid)), 10)
                started.extend(children(process.pid))
                raise TestbedError("injected: host 1 never became ready")
            holder = real_wait(process, what=what, deadline=deadline)
            started.append(holder.pid)
            return holder

        monkeypatch.setattr(bed_module, "wait_ready", failing_wait)
    testbed = Testbed(3, link_gbps=1.0)
    with pytest.raises(TestbedError) as raised:
        testbed.start()
    assert not isinstance(raised.value, TestbedUnavailable)  # a real failure, not a machine that cannot
    assert netns_names() == before
    assert not os.path.exists(run_folder(testbed.run_name))
    assert len(started) == (0 if step == "shaping" else 4)
    assert wait_until(lambda: not any(alive(pid) for pid in started), 10)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(token) for token in listing.read().split()]
    except OSError:
        return []
