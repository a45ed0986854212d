"""A Ray cluster across the emulated hosts (a raylet in each), ``CheckpointEngineManager`` with ``backend="auto"``
through the Ray adapter: it picks the two-level chain, every worker ends bit-exact, and the link counters (read
outside every host) show each byte crossed each link once — although the hosts interleave in rank order, where the
plain chain would have taken the model into each receiving host twice.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from weightsync.core.control.auto import choose
from weightsync.core.control.eviction import PING_S
from weightsync.testbed import LinkCounters, Testbed, TestbedRay

from tests.adapters.ray.leader_fault_driver import TRANSFER_TIMEOUT
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


@pytest.mark.parametrize(("killed", "mode"), [(0, "delta"), (1, "delta"), (2, "delta"), (0, "full")],
                         ids=["middle-host-leader", "last-host-leader", "in-place-reader", "middle-host-leader-full"])
def test_a_worker_killed_mid_update_is_evicted_and_the_same_call_commits_the_rest(cluster: TestbedRay,
                                                                                  killed: int, mode: str) -> None:
    """Delta updates (and, for the first case, full ones); a worker killed mid-update (``leader_fault_driver``: the
    chain's middle host's leader, its host's only replica; the last host's leader; a worker reading its host's ring
    in place). The same call evicts its replica and commits every other (a second, full transfer for those the first
    tore) within the bound, each paused once for it, and the next update is a delta for every survivor (full ones
    stay full) with no user call."""
    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.leader_fault_driver", nodes, str(killed),
                             mode], lambda message: None)
    assert result["first"]
    faulted = result["faulted"]
    assert faulted["error"] is None and faulted["ok"], faulted
    survivors = [r for r in range(3) if r != killed]
    assert faulted["states"] == ["committed", "committed"] and result["members"] == survivors, result
    [(evicted, why)] = faulted["evicted"]
    assert evicted == killed and why.startswith(f"WorkerDiedError: replica{killed}/worker0"), faulted
    # A dead leader tears the replicas reading its ring or downstream of it: they get a second transfer.
    assert ("retry_transfer" in faulted["stages"]) == (killed != 2), faulted
    bound = TRANSFER_TIMEOUT + result["setup"] + 2 * result["update"]
    assert faulted["seconds"] < bound and max(faulted["pauses"]) < bound, (faulted, bound)
    assert max(result["own_pauses"]) < bound, (result["own_pauses"], bound)  # the survivors' own hook clocks
    workers = 2 if killed == 0 else 3
    assert result["digests"] == [result["expected"]] * workers  # that same call
    for hooks in (worker for replica in result["hooks"] for worker in replica):
        assert hooks[-1] == "resume_generation" and hooks.count("resume_generation") == 3, result["hooks"]
    following = result["next"]
    received = "changes" if mode == "delta" else "full"
    assert following["ok"] and following["rebuilt"] and following["received"] == [received] * 2, following
    assert result["digests_next"] == [result["expected_next"]] * workers


def test_faults_while_staging_leave_every_replica_serving_its_old_version(cluster: TestbedRay) -> None:
    """``SyncConfig(staged=True)``: a receiving host's link cut mid-stage, then the sender killed mid-stage. Every
    replica's own hook log shows it was never paused for either, and every worker still holds the old version.
    Between them a host's stager is killed mid-stage: its replica is evicted and the same call restages the host
    for the other replica there, which is paused only for its swap."""
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
    assert result["first"]
    for fault, after, version, workers in (("cut", "after_cut", "v1", [2, 1, 1]),
                                           ("killed", "after_kill", "v4", [2, 1])):
        assert result[fault]["error"] is not None, result[fault]
        # Within the transfer timeout + 1 s; a cut one adds the eviction's ping, which finds host 3's two replicas
        # silent: more than SyncConfig.max_evicted, so the update fails as a whole, evicting none.
        assert result[fault]["seconds"] < 0.6 + 6.0 + 1.0 + (PING_S if fault == "cut" else 0), result[fault]
        rounds = 1 if fault == "cut" else 3
        assert result[after]["hooks"] == [[once * rounds] * count for count in workers], (fault, result[after])
        held = 1 if fault == "cut" else 4
        assert result[after]["states"] == [["committed", held, True, 0.0]] * len(workers), (fault, result[after])
        assert result[after]["digests"] == [result[version]] * sum(workers), fault
    evicting = result["evicting"]
    assert evicting["error"] is None and evicting["ok"] and [r for r, _ in evicting["evicted"]] == [1], evicting
    assert "retry_transfer" in evicting["stages"], evicting
    assert result["after_evict"]["hooks"] == [[once * 3] * 2, [once * 3]]  # paused once, for its swap
    assert result["after_evict"]["digests"] == [result["v4"]] * 3
    repaired = result["repaired"]
    assert repaired["ok"] and repaired["rebuilt"] and repaired["digests"] == [result["v3"]] * 4
    assert [state[:3] for state in repaired["states"]] == [["committed", 3, True]] * 3


def test_a_replica_that_joins_catches_up_from_a_peer_while_the_others_serve(cluster: TestbedRay) -> None:
    """Delta updates of a 64 MiB model; after 3 of them a replica joins on host 3 and catches up from replica 0 on
    host 2 (``join_driver``): the actor rank's host sends at most 5 % of the model meanwhile (its link counters, an
    idle window as long subtracted), the serving replicas' longest gap between probe requests stays within twice
    their median gap before it, the newcomer held the version when it was resumed, and the next update is a delta
    for all three replicas."""
    marks: dict[str, tuple[LinkCounters, ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = cluster.bed.counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.join_driver", nodes], on_request)
    model = result["model_bytes"]
    during = [after - before for before, after in zip(marks["catch_up0"], marks["catch_up1"])]
    idle = [after - before for before, after in zip(marks["idle0"], marks["idle1"])]
    sender_egress = during[1].egress_bytes - idle[1].egress_bytes
    assert sender_egress <= 0.05 * model, (sender_egress, model)
    assert during[2].egress_bytes >= 0.95 * model, during  # the peer's host sent it
    assert result["status"] == [["committed", 3]] * 3, result["status"]
    assert result["newcomer_at_resume"] == result["expected"]
    for replica, gaps in enumerate(result["gaps"]):
        assert len(gaps["before"]) >= 10 and gaps["during"], gaps
        assert max(gaps["during"]) <= 2 * statistics.median(gaps["before"]), (
            replica, max(gaps["during"]), statistics.median(gaps["before"]), result["catch_up_seconds"])
    following = result["next"]
    assert following["ok"] and following["received"] == ["changes"] * 3, following
    assert following["wire_bytes"] <= 3 * following["changed"] + 0.01 * model, following
    assert result["digests"] == [result["expected_next"]] * 3
