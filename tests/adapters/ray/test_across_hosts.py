"""A Ray cluster across the emulated hosts (a raylet in each), ``CheckpointEngineManager`` with ``backend="auto"``
through the Ray adapter: it picks the two-level chain, every worker ends bit-exact, and the link counters (read
outside every host) show each byte crossed each link once — although the hosts interleave in rank order, where the
plain chain would have taken the model into each receiving host twice.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from weightsync.core.control.auto import choose
from weightsync.testbed import LinkCounters, Testbed, TestbedRay

from tests.tools.testbed.driving import steer
from tests.tools.testbed.support import start_or_skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestbedRay]:
    bed = start_or_skip(Testbed(4, link_gbps=2.0))
    try:
        with TestbedRay(bed) as ray_cluster:
            yield ray_cluster
    finally:
        bed.close()


def run(cluster: TestbedRay, *backend: str) -> tuple[dict[str, Any], list[LinkCounters]]:
    """The driver's result, and each host's link counters over its second update."""
    marks: dict[str, tuple[LinkCounters, ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = cluster.bed.counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.across_hosts_driver", nodes, *backend],
                   on_request)
    assert result["first"] and result["ok"]
    assert result["digests"] == [result["expected"]] * 4  # what each worker holds, hashed in its own process
    return result, [after - before for before, after in zip(marks["before"], marks["after"])]


def test_auto_moves_each_byte_across_each_link_once(cluster: TestbedRay) -> None:
    result, moved = run(cluster)
    expected_choice = choose(sender_node="host 1", rollout_nodes=["host 2", "host 3"])
    assert result["backend"] == expected_choice.backend, result  # the backend that ran: auto's pick
    assert result["chosen"].startswith(f"{expected_choice.name}:"), result
    assert expected_choice.options == {"layout": "two_level"}  # a chain backend is installed where this runs
    size = result["nbytes"]
    assert 0.95 * size <= moved[1].egress_bytes <= 1.2 * size, moved  # the sender's host sent the model once
    for host in (2, 3):
        assert 0.95 * size <= moved[host].ingress_bytes <= 1.2 * size, moved  # into each host once
    assert moved[2].egress_bytes <= 1.2 * size and moved[3].egress_bytes <= 0.1 * size  # host 2 relays to host 3


def test_the_rank_order_chain_takes_the_model_into_each_host_twice(cluster: TestbedRay) -> None:
    """Negative control of the link checks above: the plain chain (nixl named, no layout) on the same placement."""
    result, moved = run(cluster, "nixl")
    assert result["chosen"] == ""
    size = result["nbytes"]
    for host in (2, 3):
        assert moved[host].ingress_bytes >= 1.9 * size, moved


def test_a_killed_host_leader_tears_its_host_only_and_another_leads_next(cluster: TestbedRay) -> None:
    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.leader_fault_driver", nodes],
                   lambda message: None)
    assert result["first"]
    faulted = result["faulted"]
    assert faulted["error"] == "WorkerDiedError" and "replica1/worker0" in faulted["message"], faulted
    assert faulted["seconds"] < 6.0 + 1.0, faulted
    # Host 3's workers (replica 1, killed; replica 2, reading its ring) are torn; host 2's replica committed.
    assert result["states"] == ["committed", "torn", "torn"], result["states"]
    replica0_hooks, replica2_hooks = result["hooks"]
    assert all(hooks[-1] == "resume_generation" for hooks in replica0_hooks)  # resumed, both workers
    assert replica2_hooks[0][-1] == "release_kv_cache"  # torn: paused, never resumed
    # Replica 1 removed: replica 2's worker leads host 3, and every worker that is left ends bit-exact.
    assert result["next"]["ok"] and result["next"]["rebuilt"] and "two-level" in result["next"]["chosen"]
    assert result["digests"] == [result["expected"]] * 3


def test_faults_while_staging_leave_every_replica_serving_its_old_version(cluster: TestbedRay) -> None:
    """``SyncConfig(staged=True)``: a receiving host's link cut mid-stage, then the sender killed mid-stage. Every
    replica's own hook log shows it was never paused for either, and every worker still holds the old version."""
    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})

    def on_request(message: dict[str, Any]) -> None:
        if "cut" in message:
            cluster.bed.link_down(int(message["cut"]))
        elif "restore" in message:
            cluster.bed.link_up(int(message["restore"]))

    try:
        result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.staged_fault_driver", nodes], on_request)
    finally:
        if not cluster.bed.link_is_up(3):
            cluster.bed.link_up(3)
    once = ["abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"]
    workers = [2, 1, 1]
    assert result["first"]
    for fault, after, version in (("cut", "after_cut", "v1"), ("killed", "after_kill", "v3")):
        assert result[fault]["error"] is not None, result[fault]
        assert result[fault]["seconds"] < 0.6 + 6.0 + 1.0, result[fault]  # within the transfer timeout + 1 s
        rounds = 1 if fault == "cut" else 2
        assert result[after]["hooks"] == [[once * rounds] * count for count in workers], (fault, result[after])
        held = 1 if fault == "cut" else 3
        assert result[after]["states"] == [["committed", held, True, 0.0]] * 3, (fault, result[after])
        assert result[after]["digests"] == [result[version]] * 4, fault
    repaired = result["repaired"]
    assert repaired["ok"] and repaired["rebuilt"] and repaired["digests"] == [result["v3"]] * 4
    assert [state[:3] for state in repaired["states"]] == [["committed", 3, True]] * 3
