"""Several rails per host through the Ray adapter: a testbed of three hosts with two rails each (a raylet in each),
an actor worker group of two ranks on host 1 and a replica of two workers on host 2, ``backend="auto"``. The
adapter gives each actor its local rank, the host's environment its rail addresses; auto deals the update into two
stripes, every worker ends bit-exact, and the rails' own counters (read outside every host) show both rails of each
host carrying half the model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from weightsync.api.registry import available_backends
from weightsync.testbed import LinkCounters, TestbedRay

from tests.adapters.ray.railbed import rail_cluster, rail_fault
from tests.tools.testbed.driving import steer


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestbedRay]:
    yield from rail_cluster(2)


@pytest.mark.parametrize(("backend", "staged"), [("auto", False), ("auto", True), ("nixl", False)])
def test_each_stripe_crosses_its_own_rail(cluster: TestbedRay, backend: str, staged: bool) -> None:
    """Staged too: the receiving host's two workers each stage the stripe of their rail into an area of their own,
    and both swap from both areas (bit-exact in each worker's own process). nixl named with stripes: each ring's
    UCX is held to its worker's rail (left alone, UCX read both stripes over rail 0: rail 1 carried nothing)."""
    if backend != "auto" and backend not in available_backends():
        pytest.skip(f"{backend} is not installed")
    marks: dict[str, tuple[tuple[LinkCounters, ...], ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = cluster.bed.rail_counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    # 1 MiB buckets: 28 of them, dealt alternately over the two stripes.
    options = {"layout": "two_level", "stripes": "rails"} if backend != "auto" else {}
    placement = json.dumps({"actor_ranks": 2, "replicas": [["2", "2"]], "bucket_mb": 1, "staged": staged,
                            "options": options})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.across_hosts_driver", nodes, backend,
                             placement], on_request)
    assert result["first"] and result["ok"]
    assert result["digests"] == [result["expected"]] * 2  # what each worker holds, hashed in its own process
    assert "(two-level, 2 stripes)" in result["chosen"] or backend != "auto", result
    assert result["senders"] == 2  # both actor ranks sent a part
    assert result["swapped"] == [staged], result  # the manager's staged path: stage, then a swap
    moved = [[after - before for before, after in zip(host_before, host_after)]
             for host_before, host_after in zip(marks["before"], marks["after"])]
    size = result["nbytes"]
    for rail in (0, 1):  # each rail of the sender's host out, and of the receiving host in: half the model each
        assert 0.45 * size <= moved[1][rail].egress_bytes <= 0.65 * size, moved
        assert 0.45 * size <= moved[2][rail].ingress_bytes <= 0.65 * size, moved


@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
def test_each_rank_of_a_sharded_actor_wg_sends_its_shards_over_its_own_rail(cluster: TestbedRay, staged: bool) -> None:
    """Two actor ranks hold an FSDP2-sharded model (``tests.workloads.FsdpTpSource``) and each sends only its shards,
    over a two-level chain of its own on its rail (``auto``): on the rails' own counters each rail of the sender's
    host carries half the model out and each rail of the receiving host half in, and both workers end bit-exact. With
    delta updates: the measured update (every bucket changed) moves the model so; the next, a few elements apart,
    only changes, each rank's against its own base, bit-exact. Staged, with a second replica on host 0: every host
    has a stager per rank, each staging its rank's stream (host 0's from host 2's, over the same rail), and every
    worker swaps from both areas of its host."""
    marks: dict[str, tuple[tuple[LinkCounters, ...], ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = cluster.bed.rail_counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    replicas = [["2", "2"], ["0", "0"]] if staged else [["2", "2"]]
    placement = json.dumps({"actor_ranks": 2, "replicas": replicas, "bucket_mb": 1, "sharded": True, "delta": True,
                            "staged": staged})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.across_hosts_driver", nodes, "auto",
                             placement], on_request)
    assert result["first"] and result["ok"], result
    workers = 2 * len(replicas)
    assert result["digests"] == [result["expected"]] * workers  # the whole model, in each worker's own process
    assert result["senders"] == 2 and result["swapped"] == [staged] * len(replicas), result
    # The report says what ran: a stream per sending rank, not auto's stripes.
    assert "stripes" not in result["chosen"].split(":")[0] and "2 sending ranks" in result["chosen"], result
    moved = [[after - before for before, after in zip(host_before, host_after)]
             for host_before, host_after in zip(marks["before"], marks["after"])]
    size = result["nbytes"]
    for rail in (0, 1):
        assert 0.45 * size <= moved[1][rail].egress_bytes <= 0.65 * size, moved
        assert 0.45 * size <= moved[2][rail].ingress_bytes <= 0.65 * size, moved
    nudged = result["delta"]
    assert nudged["ok"] and nudged["received"] == ["changes"] * len(replicas), nudged
    assert nudged["digests"] == [nudged["expected"]] * workers and nudged["wire"] < size / 50, (nudged, size)


def test_a_sharded_actor_wg_moves_nothing_over_its_own_fabric_where_the_gathered_one_moves_half_the_model(
        cluster: TestbedRay) -> None:
    """No gather on the trainer: two FSDP2 ranks on hosts 1 and 0 whose gloo group runs over rail 1 (the trainer's
    own fabric), weights over rail 0 to a replica on host 2. By rail 1's counters of both trainer hosts, sharded
    ranks (each sends its own blocks) move at most 2 % of the model during an update; the same ranks streaming
    gathered tensors (``full_tensor()``, rank 0 sends: the negative control) move at least 0.4 of it. Both
    bit-exact; sharded, each rank sent half the model over rail 0 of its own host."""
    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    fabric: dict[str, float] = {}
    for mode in ("sharded", "gathered"):
        marks: dict[str, tuple[tuple[LinkCounters, ...], ...]] = {}

        def on_request(message: dict[str, Any]) -> None:
            marks[message["mark"]] = cluster.bed.rail_counters()

        result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.fabric_driver", nodes, mode], on_request)
        assert result["first"] and result["ok"], result
        assert result["digests"] == [result["expected"]] * 2, result
        moved = [[after - before for before, after in zip(host_before, host_after)]
                 for host_before, host_after in zip(marks["before"], marks["after"])]
        size = result["nbytes"]
        fabric[mode] = sum(moved[host][1].egress_bytes + moved[host][1].ingress_bytes for host in (0, 1)) / size
        if mode == "sharded":
            assert sorted(result["sent"]) == [size // 2, size - size // 2] or min(result["sent"]) > 0.45 * size
            for host in (0, 1):  # each rank's half, out over rail 0 of its own host
                assert 0.45 * size <= moved[host][0].egress_bytes <= 0.65 * size, moved
    print(f"trainer fabric per update (of the model): {fabric}")  # noqa: T201 - the figures, in the test's log
    assert fabric["sharded"] <= 0.02 and fabric["gathered"] >= 0.4, fabric


@pytest.mark.parametrize(("mode", "staged"), [("drop", False), ("carrier", False), ("drop", True)])
def test_a_rail_lost_mid_update_is_named_and_left_out_until_it_answers_again(cluster: TestbedRay, mode: str,
                                                                             staged: bool) -> None:
    """Rail 1 of the receiving host cut mid-update (packets dropped, carrier kept; or carrier lost): the update
    raises a ``TransferError`` naming the stripe's rail and both hosts, within the transfer timeout and a second;
    the replica, if its workers had taken part of the update, stays paused (torn); a staged update's replica, whose
    host never held both stripes, is never paused and serves its old version. The next update, the rail still
    down, completes whole over rail 0 alone (its probe of rail 1 fails: no stripes, rail 1 idle by its counters);
    once the rail is back, the probe reaches it and the update is dealt over both rails again."""
    result, moved = rail_fault(cluster, mode, {"staged": staged})
    assert result["first"] and "2 stripes" in result["chosen"], result
    faulted = result["faulted"]
    assert faulted["error"] == "TransferError", faulted
    assert "over rail 1 from host wst-h1 to host wst-h2" in faulted["message"], faulted
    assert faulted["seconds"] <= 6.0 + 1.0 + 0.6, faulted  # the transfer timeout + 1 s, after the fault's 0.6 s
    # No torn replica resumed: one that took part of the update stays paused; one the failure left untouched (no
    # byte had reached it yet, on a loaded machine) resumes on its old weights.
    ((state, resumed),) = result["states"]
    assert (state, resumed) in (("torn", False), ("committed", True)), result
    if staged:  # paused once, for the first update's swap: the failed stage never paused it
        assert (state, resumed) == ("committed", True) and result["hooks"][0].count("abort_all_requests") == 1, result
    if state == "torn":
        assert result["hooks"][0][-2:] == ["abort_all_requests", "release_kv_cache"], result  # paused, never resumed
    down, restored = result["down"], result["restored"]
    assert down["ok"] and down["whole"] and "stripes" not in down["chosen"].split(":")[0], down
    assert "rail 1 left out" in down["chosen"], down
    assert moved[2][0].ingress_bytes >= 0.95 * down["nbytes"] and moved[2][1].ingress_bytes < 0.05 * down["nbytes"]
    assert restored["ok"] and restored["whole"] and "(two-level, 2 stripes)" in restored["chosen"], restored


def test_a_part_group_s_rail_lost_mid_update_is_named_and_left_out_until_it_answers_again(cluster: TestbedRay) -> None:
    """Parts: the replica's two workers on host 0 hold the first half of the layers, its two on host 2 the rest, so
    ``auto``'s part groups each take a rail of their own (host 0's group rail 0, host 2's rail 1), one stream each.
    Rail 1 of host 2 dropped mid-update: the update raises a ``TransferError`` naming the stream's rail and both
    hosts (before, the group's plain chain raised a timeout naming no rail, and every later update went over rail 1
    again). The next update, the rail still down, leaves rail 1 out: its one actor rank on rail 0 cannot send two
    groups, so one stream over rail 0 serves both hosts (host 2 takes in the whole model over rail 0, nothing over
    rail 1), each worker still verifying its part and handed only its half (its sink's digest: the tensors of its
    half alone); restored, the groups take a rail each again."""
    result, moved = rail_fault(cluster, "drop", {"parts": True})
    assert result["first"] and "(two-level, 2 part groups)" in result["chosen"], result
    faulted = result["faulted"]
    assert faulted["error"] == "TransferError", faulted
    assert "stream over rail 1 from host wst-h1 to host wst-h2" in faulted["message"], faulted
    assert faulted["seconds"] <= 6.0 + 1.0 + 0.6, faulted
    down, restored = result["down"], result["restored"]
    assert down["ok"] and down["whole"] and "rail 1 left out" in down["chosen"], down
    assert "part groups" not in down["chosen"].split(":")[0], down
    assert moved[2][0].ingress_bytes >= 0.95 * down["nbytes"] and moved[2][1].ingress_bytes < 0.05 * down["nbytes"]
    assert restored["ok"] and restored["whole"] and "(two-level, 2 part groups)" in restored["chosen"], restored
