"""Faults across hosts: a link goes down mid-update on the emulated testbed, with a Ray cluster spanning its hosts.

Layout (4 hosts, 1 Gb/s links): host 0 runs Ray's head and the driver (``host_fault_driver``), host 1 the actor
worker group, hosts 2 and 3 one replica each. Every byte between them, Ray's control traffic included, crosses the
links. Two cases per backend that crosses hosts, and for ``auto``: the link of a receiving host (3) goes down
mid-update, and the link of the sending host (1) — every packet dropped both ways; once, for nixl, the receiving
host's veth loses its carrier instead. The sending host's must end within the transfer timeout + 1 s with
``HostUnreachableError`` naming exactly that host and resume no torn replica (read from the hooks each replica's
own process recorded). The receiving host's replica is evicted (``SyncConfig.max_evicted``: its host is silent,
named by the same ``HostUnreachableError``) and the same call commits the other replica, within the transfer
timeout + 1 s + a second transfer where the first tore it; the evicted one, torn, is never resumed. Then — the link
restored, the evicted replica added back — the next update commits bit-exact on every replica (digests of what the
replicas hold, against the source's own).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from weightsync.testbed import LinkMode, Testbed, TestbedRay

from tests.reliability.host_fault_driver import SLOW_TENSOR_S, TRANSFER_TIMEOUT
from tests.tools.testbed.driving import steer
from tests.tools.testbed.support import start_or_skip

# auto (the manager's default) picks tcp in the two-level layout across these hosts (no RDMA devices): check_fault
# asserts its pick.
CROSSING_BACKENDS = ["nixl", "mooncake", "gloo", "auto"]
SLACK = 1.0
SENDER_HOST, RECEIVING_HOST = 1, 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestbedRay]:
    bed = start_or_skip(Testbed(4, link_gbps=1.0))
    try:
        with TestbedRay(bed) as ray_cluster:
            yield ray_cluster
    finally:
        bed.close()


def run_case(cluster: TestbedRay, backend: str, victim: int, mode: LinkMode = "drop") -> dict[str, Any]:
    """Run the driver; take ``victim``'s link down (``mode``) and up when it asks; its result."""
    bed = cluster.bed
    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})

    def on_request(message: dict[str, Any]) -> None:
        if "fault" in message:
            bed.link_down(message["fault"], mode=mode)
        else:
            bed.link_up(message["restore"])

    try:
        return steer(cluster, [sys.executable, "-m", "tests.reliability.host_fault_driver", backend, str(victim),
                               nodes], on_request)
    finally:
        if not bed.link_is_up(victim):
            bed.link_up(victim)


def check_fault(result: dict[str, Any], cluster: TestbedRay, victim: int, backend: str) -> None:
    assert result["first"] is True
    if backend == "auto":
        assert result["chosen"].startswith("tcp (two-level): "), result["chosen"]
    else:
        assert result["chosen"] == "", result["chosen"]  # an explicit backend is that backend, no choice made
    faulted = result["faulted"]
    host = cluster.bed.hosts[victim]
    error = faulted["error"]
    assert error is not None, "the update succeeded although a link was down"
    assert error["type"] == "HostUnreachableError", error
    assert error["details"]["hosts"] == [f"{host.hostname} ({host.address})"], error  # that host, and only it
    assert host.hostname in error["message"] and error["details"]["step"] == "transfer"
    print(f"host {victim} cut: {type_name(error)} after {faulted['seconds']:.2f} s: {error['message']}")
    assert faulted["seconds"] < TRANSFER_TIMEOUT + SLACK, faulted
    for replica, (state, hooks) in enumerate(zip(result["states"], result["hooks_after_fault"])):
        # Each replica's process logged its hooks: a torn replica stays paused, a committed one was resumed.
        expected_last = "release_kv_cache" if state == "torn" else "resume_generation"
        assert state in ("torn", "committed") and hooks[-1] == expected_last, (replica, state, hooks)


def check_evicted(result: dict[str, Any], cluster: TestbedRay, victim: int, backend: str) -> None:
    assert result["first"] is True
    faulted, host = result["faulted"], cluster.bed.hosts[victim]
    assert faulted["error"] is None, faulted
    [(replica, why)] = faulted["evicted"]
    assert replica == 1 and why.startswith("HostUnreachableError") and host.hostname in why, faulted
    second = 12 * SLOW_TENSOR_S + 1.0  # a second transfer, setup included, where the first tore replica 0
    print(f"host {victim} cut ({backend}): replica 1 evicted after {faulted['seconds']:.2f} s")
    assert faulted["seconds"] < TRANSFER_TIMEOUT + SLACK + second, faulted
    assert result["states"] == ["committed"], result["states"]
    kept, evicted = result["hooks_after_fault"]
    assert kept[-1] == "resume_generation" and evicted[-1] == "release_kv_cache", result["hooks_after_fault"]
    assert result["digests_after_fault"][0] == result["expected_faulted"]


def type_name(error: dict[str, Any]) -> str:
    return str(error["type"])


def check_recovery(result: dict[str, Any]) -> None:
    assert result["next"] == {"ok": True, "states": ["committed", "committed"]}, result["next"]
    assert result["digests"] == [result["expected"]] * 2
    assert all(hooks[-1] == "resume_generation" for hooks in result["hooks"])


# Run by a driver in host 0: where a task asking for each host's resource runs, as that process sees itself.
WHERE_TASKS_RUN = """
import json, os, socket, ray
from weightsync.testbed import testbed_host_resource
ray.init(logging_level="ERROR", log_to_driver=False)
@ray.remote(num_cpus=0)
def where():
    return [socket.gethostname(), os.environ.get("WEIGHTSYNC_TESTBED_HOST"), ray.get_runtime_context().get_node_id()]
hosts = int(os.environ["WEIGHTSYNC_TESTBED_HOSTS"])
print("where:", json.dumps([ray.get(where.options(resources={testbed_host_resource(h): 1}).remote())
                            for h in range(hosts)]))
"""


def test_every_host_runs_its_own_raylet(cluster: TestbedRay) -> None:
    done = cluster.bed.run(0, [sys.executable, "-c", WHERE_TASKS_RUN], env=cluster.driver_env(), timeout=120)
    line = next(line for line in done.stdout.decode().splitlines() if line.startswith("where: "))
    seen = json.loads(line.removeprefix("where: "))
    assert seen == [[host.hostname, str(host.index), node]
                    for host, node in zip(cluster.bed.hosts, cluster.node_ids)]
    assert len(set(cluster.node_ids)) == 4


@pytest.mark.parametrize("backend, mode", [*((name, "drop") for name in CROSSING_BACKENDS), ("nixl", "carrier")])
def test_receiving_host_link_down_mid_update(cluster: TestbedRay, backend: str, mode: LinkMode) -> None:
    result = run_case(cluster, backend, RECEIVING_HOST, mode)
    check_evicted(result, cluster, RECEIVING_HOST, backend)
    check_recovery(result)


@pytest.mark.parametrize("backend", CROSSING_BACKENDS)
def test_sender_host_link_down_mid_update(cluster: TestbedRay, backend: str) -> None:
    result = run_case(cluster, backend, SENDER_HOST)
    check_fault(result, cluster, SENDER_HOST, backend)
    assert result["states"] == ["torn", "torn"]  # nothing complete reached either replica
    check_recovery(result)
