"""`weightsync bench --hosts` as a user runs it: a real testbed (network namespaces, shaped veth links), the workers
started inside its hosts, real transports across the links, and `bench --cleanup` after a killed run.

Where this machine cannot build a testbed these tests skip with its one-line reason (and fail where
``WEIGHTSYNC_REQUIRE_TESTBED=1``, as in CI). No timing assertions beyond what a link physically allows: the machine
is shared. What is checked is the JSON's shape, that its figures agree with each other, and that the link counters
(read by the driver from the switch side of each link, outside every host and every engine) saw every update's
bytes cross: at least 0.95 × S out of the sender's host and into each receiving host.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
from weightsync.api.registry import available_backends
from weightsync.cli.bench.scenario import BenchOptions, bench_part, make_case
from weightsync.cli.main import main
from weightsync.core.control.auto import choose
from weightsync.testbed import probe

from tests.tools.testbed.support import netns_names, skip_unless_testbed, wait_until

HOSTS_RESULT_KEYS = {"backend", "gbps_p50", "gbps_p90", "ratio_bucketed", "ratio_limit", "ratio_engine_copy_limit",
                     "peak_extra_rss_mb", "ratio_link_limit", "sender_egress_bytes", "host_ingress_bytes",
                     "rail_egress_bytes", "rail_ingress_bytes"}
# The transports where bytes could bypass a link (one-sided reads through UCX or Mooncake); gloo's engine uses the
# same TCP as the baselines, which run anyway.
CROSSING = ("nixl", "mooncake")
LINK_GBPS = 1.0
MODEL_BYTES = 16 * 2**20


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOG_minloglevel": "2"}
    return subprocess.run([sys.executable, "-m", "weightsync.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


@pytest.fixture(scope="module")
def hosts_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, list[str]]:
    skip_unless_testbed()
    backends = [*(name for name in CROSSING if name in available_backends()), "auto"]
    out = tmp_path_factory.mktemp("bench-hosts") / "hosts.json"
    # shm is asked for explicitly: it must be left out, not fail the run.
    result = bench("--hosts", "3", "--receivers", "1", "--link-gbps", str(LINK_GBPS), "--model-mb", "16",
                   "--bucket-mb", "4", "--repeat", "2", "--backends", ",".join([*backends, "shm"]),
                   "--parts", "layers2", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text()), result.stdout, backends


def test_json_keeps_the_schema_and_adds_the_testbed_fields(hosts_run: tuple[dict[str, Any], str, list[str]]) -> None:
    data, stdout, backends = hosts_run
    assert set(data) == {"scenario", "limit_gbps", "engine_copy_limit_gbps", "raw_gloo_gbps", "link_limit_gbps",
                         "results", "ray_end_to_end"}
    # --parts layers2: auto's twin only (its two-level layout delivers by part; see test_parts_across_hosts...)
    assert [row["backend"] for row in data["results"]] == [*backends, "auto+layers2", "naive", "bucketed"]
    engines = {"report", "busy_seconds_p50"}  # an engine entry's: the manager's report of its last update
    assert all(set(row) == HOSTS_RESULT_KEYS | (set() if row["backend"] in ("naive", "bucketed") else engines)
               for row in data["results"] if not row["backend"].startswith("auto"))
    auto = next(row for row in data["results"] if row["backend"] == "auto")
    assert set(auto) == HOSTS_RESULT_KEYS | {"chosen"} | engines
    parted = next(row for row in data["results"] if row["backend"] == "auto+layers2")
    assert set(parted) == HOSTS_RESULT_KEYS | {"chosen", "parts_of", "ratio_seconds_whole", "ratio_busy_whole",
                                               "receivers_rss_mb", "whole_receivers_rss_mb", "replicated_bytes"
                                               } | engines
    assert auto["chosen"] == choose(sender_node="0", rollout_nodes=["1", "2"]).name  # e.g. "nixl (two-level)"
    assert f"(auto picked {auto['chosen']} here)" in stdout
    scenario = data["scenario"]
    assert scenario["hosts"] == 3 and scenario["link_gbps"] == LINK_GBPS and scenario["rails"] == 1
    assert scenario["skipped"] == ["shm"] and scenario["backends"] == backends
    # --receivers is per receiving host: 2 receiving hosts, 1 each.
    assert scenario["receivers"] == 2 and scenario["receivers_per_host"] == 1
    assert scenario["model_bytes"] == MODEL_BYTES and scenario["bucket_mb"] == 4
    # The link's rate in decimal GB/s.
    assert data["link_limit_gbps"] == pytest.approx(LINK_GBPS / 8)
    assert data["ray_end_to_end"] == {"skipped": "--hosts"}
    assert "skipped (cannot cross hosts): shm" in stdout and "ray end-to-end: skipped (--hosts)" in stdout


def test_figures_agree_and_no_update_beats_the_link(hosts_run: tuple[dict[str, Any], str, list[str]]) -> None:
    data, _, _ = hosts_run
    scenario, limit = data["scenario"], data["link_limit_gbps"]
    for row in data["results"]:
        seconds = scenario["seconds"][row["backend"]]
        assert len(seconds) == 2
        # gbps_p50 stays S / update time (the median over the updates), and ratio_link_limit is it over the
        # link's rate...
        assert row["gbps_p50"] == pytest.approx(statistics.median(MODEL_BYTES / s / 1e9 for s in seconds), rel=1e-2)
        assert row["ratio_link_limit"] == pytest.approx(row["gbps_p50"] / limit, rel=1e-2)
        # ...which no update can beat through the sender's link (tbf lets a 256 KiB burst through at line rate).
        assert row["gbps_p50"] <= limit * (1 + 256 * 1024 / MODEL_BYTES) * 1.02, row


def test_link_counters_show_every_update_crossing_every_link(
    hosts_run: tuple[dict[str, Any], str, list[str]]
) -> None:
    data, _, backends = hosts_run
    per_update = data["scenario"]["link_bytes"]
    for row in data["results"]:
        name = row["backend"]
        egress, ingress = per_update[name]["sender_egress"], per_update[name]["host_ingress"]
        assert len(egress) == len(ingress) == 2  # one reading per timed update
        for update_egress, update_ingress in zip(egress, ingress):
            assert update_egress >= 0.95 * MODEL_BYTES, (name, update_egress)
            assert len(update_ingress) == 2
            if name != "auto+layers2":  # (each host its half: test_parts_across_hosts_...)
                assert all(value >= 0.95 * MODEL_BYTES for value in update_ingress), (name, update_ingress)
        # The entry holds the median per update.
        assert row["sender_egress_bytes"] == int(statistics.median(egress))
        assert row["host_ingress_bytes"] == [int(statistics.median(update[host] for update in ingress))
                                             for host in range(2)]
        # One rail: its figures are the hosts' (a list of one per host).
        assert row["rail_egress_bytes"] == [row["sender_egress_bytes"]]
        assert row["rail_ingress_bytes"] == [[value] for value in row["host_ingress_bytes"]]
    rows = {row["backend"]: row for row in data["results"]}
    # The counters tell topologies apart, so they count real transfers: a chain's sender reads out S once (headers
    # on top), gloo's broadcast from rank 0 sends S to each of the two receiving hosts.
    for name in backends:
        assert rows[name]["sender_egress_bytes"] <= 1.1 * MODEL_BYTES, rows[name]
    for name in ("naive", "bucketed"):
        assert rows[name]["sender_egress_bytes"] >= 1.9 * MODEL_BYTES, rows[name]


def test_parts_across_hosts_each_host_takes_in_only_its_half(hosts_run: tuple[dict[str, Any], str, list[str]]
                                                               ) -> None:
    """``--parts layers2`` across 3 hosts: each replica's two workers sit on hosts 1 and 2, each holding half the
    layers. By the link counters each receiving host takes in its half (the tensors its workers hold, headers on
    top) and the sender's host sends out the model once, as two streams (``auto``'s part groups: one sender each);
    the whole-model entry of the same run, the control, takes the model into each host."""
    data, _, _ = hosts_run
    rows = {row["backend"]: row for row in data["results"]}
    check_each_host_takes_in_its_half(rows["auto+layers2"], whole=rows["auto"])
    assert rows["auto+layers2"]["parts_of"] == "auto" and "parts (layers2" in hosts_run[1]


def check_each_host_takes_in_its_half(parted: dict[str, Any], *, whole: dict[str, Any], parts: str = "layers2"
                                      ) -> None:
    """``--hosts 3 --parts layers2|tp2``: by the link counters each receiving host took in its workers' part (the
    tensors they hold, or with ``tp2`` their rank's half of every split tensor and the norms whole, headers on top)
    while the whole-model entry of the same run (the control) took the model into each host; the sender's host sent
    both parts once, as two streams; every replica committed."""
    layout = make_case("auto", BenchOptions(hosts=3, receivers=1, model_mb=16, bucket_mb=4)).layout
    halves = [sum(2 * math.prod(region.size if region is not None else shape) for name, shape in layout
                  for region in bench_part(layout, parts, rank).regions(name) or [None]
                  if bench_part(layout, parts, rank).regions(name) != ()) for rank in (0, 1)]
    assert sum(halves) == MODEL_BYTES + parted["replicated_bytes"] and min(halves) > 0.3 * MODEL_BYTES
    assert (parted["replicated_bytes"] > 0) is (parts == "tp2")
    for host, half in enumerate(halves):
        assert half <= parted["host_ingress_bytes"][host] <= half + 0.02 * MODEL_BYTES, (host, parted, halves)
        assert whole["host_ingress_bytes"][host] >= 0.95 * MODEL_BYTES, whole
    assert sum(halves) <= parted["sender_egress_bytes"] <= sum(halves) + 0.04 * MODEL_BYTES, parted
    senders = [t for t in parted["report"]["transfers"] if t["role"] == "actor" and t["nbytes"]]
    assert sorted(t["nbytes"] for t in senders) == sorted(halves)  # a stream per host
    assert {t["sender"] for t in parted["report"]["transfers"] if t["role"] == "rollout"} == {0, 1}
    assert {outcome["state"] for outcome in parted["report"]["replicas"]} == {"committed"}


def test_delta_updates_cross_the_links_as_a_few_percent_of_the_model(tmp_path: pathlib.Path) -> None:
    """``--mix rl --delta`` across links: by the link counters, each delta update's bytes are at most 3 × the
    changed bytes + 1 % of S, while the full updates of the same run (the negative control: the counters do see a
    whole model) carry at least 0.95 × S. With ``--parts tp2`` (each replica's two workers on hosts 1 and 2, each
    holding its rank's half of every split matrix: each part group's sender keeps the base of its spans,
    ``weightsync.core.wire.carriers``) each host takes in only the changes to its half: the two hosts' ingress
    together is about one host's of the whole-model delta entry, and each host's well below it."""
    skip_unless_testbed()
    out = tmp_path / "delta.json"
    result = bench("--hosts", "3", "--receivers", "1", "--link-gbps", str(LINK_GBPS), "--mix", "rl", "--model-mb",
                   "16", "--bucket-mb", "4", "--repeat", "2", "--backends", "auto", "--delta", "--parts", "tp2",
                   "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    scenario = data["scenario"]
    total, changed = scenario["model_bytes"], scenario["changed_fraction"] * scenario["model_bytes"]
    assert 0 < changed < 0.2 * total
    links = scenario["link_bytes"]
    assert all(egress >= 0.95 * total for egress in links["auto"]["sender_egress"])
    for egress, ingress in zip(links["auto+delta"]["sender_egress"], links["auto+delta"]["host_ingress"]):
        assert egress <= 3 * changed + 0.01 * total, (egress, changed)
        assert max(ingress) <= 3 * changed + 0.01 * total, (ingress, changed)
    for whole, parted in zip(links["auto+delta"]["host_ingress"], links["auto+tp2+delta"]["host_ingress"]):
        assert max(parted) <= 0.8 * min(whole) and sum(parted) <= 1.1 * max(whole), (parted, whole)
    rows = {row["backend"]: row for row in data["results"]}
    assert {outcome["received"] for outcome in rows["auto+tp2+delta"]["report"]["replicas"]} == {"changes"}
    assert {outcome["state"] for outcome in rows["auto+tp2+delta"]["report"]["replicas"]} == {"committed"}


def test_staged_updates_cross_into_each_host_once_and_only_its_part(tmp_path: pathlib.Path) -> None:
    """``--staged``: only each host's stagers join the transport, so gloo's broadcast, which sends the model to
    every receiver, takes it into each host once; its unstaged entry in the same run is the negative control (two
    receivers on a host: about 2 S in). With ``--parts tp2`` (each replica's two workers on hosts 1 and 2, each
    holding its rank's half of every split matrix and the norms whole: tensor parallelism split over hosts) a host's
    stager declares what its workers hold, its rank's regions, and each part group's sender carries of every split
    tensor only that span (``weightsync.core.wire.carriers``): each host stages only its half and the norms, while
    ``auto+staged`` of the same run, the control, stages the model on each.

    Over two rails (each host's two workers one on each): ``auto`` deals a full update into two stripes, and the
    two part groups share the rails out, one each. Staged or not, each host takes in its half all over its group's
    rail (host 1 over rail 0, host 2 over rail 1) and the sender's host sends a half over each, every worker
    verifying its part; the whole-model entries, the control, take the model into each host, half over each rail.
    (Before, the stripes won: every host took in the whole model, and a worker whose sink held only its part failed
    on the first tensor it lacked; and before carriers, hosts of tensor-parallel halves took in the whole model.)"""
    skip_unless_testbed()
    out = tmp_path / "staged.json"
    result = bench("--hosts", "3", "--receivers", "2", "--rails", "2", "--link-gbps", str(LINK_GBPS), "--model-mb",
                   "16", "--bucket-mb", "4", "--repeat", "2", "--backends", "gloo,auto", "--staged", "--parts",
                   "tp2", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    total = data["scenario"]["model_bytes"]
    links = data["scenario"]["link_bytes"]
    assert all(min(ingress) >= 1.9 * total for ingress in links["gloo"]["host_ingress"]), links["gloo"]
    assert all(0.95 * total <= min(ingress) <= max(ingress) <= 1.2 * total
               for ingress in links["gloo+staged"]["host_ingress"]), links["gloo+staged"]
    rows = {row["backend"]: row for row in data["results"]}
    assert rows["gloo+staged"]["failed_requests"] == 0 and rows["gloo+staged"]["stage_seconds"] > 0
    parted = rows["auto+tp2+staged"]
    assert parted["failed_requests"] == 0 and parted["stage_seconds"] > 0
    for entry in ("auto", "auto+staged"):
        check_each_host_takes_in_its_half(rows[entry.replace("auto", "auto+tp2")], whole=rows[entry], parts="tp2")
        check_each_host_takes_in_its_half_over_its_rail(rows[entry.replace("auto", "auto+tp2")], whole=rows[entry])


def check_each_host_takes_in_its_half_over_its_rail(parted: dict[str, Any], *, whole: dict[str, Any]) -> None:
    """Two rails, two part groups: each host's ingress all over its group's rail, the sender's egress a half over
    each rail; every worker verified its part. The whole-model entry: half over each rail into every host."""
    assert whole["chosen"].endswith("(two-level, 2 stripes)"), whole
    for host, rail in ((0, 0), (1, 1)):
        ingress = parted["rail_ingress_bytes"][host]
        assert ingress[1 - rail] < 0.01 * MODEL_BYTES <= 0.3 * MODEL_BYTES <= ingress[rail], (host, parted)
        assert abs(parted["rail_egress_bytes"][rail] - ingress[rail]) <= 0.01 * MODEL_BYTES, parted
        assert all(0.4 * MODEL_BYTES <= got <= 0.6 * MODEL_BYTES for got in whole["rail_ingress_bytes"][host]), whole
    assert all(t["part"] in (0, 1) for t in parted["report"]["transfers"] if t["role"] == "rollout"), parted


def test_bench_cleanup_removes_a_killed_runs_leftovers() -> None:
    skip_unless_testbed()
    process = subprocess.Popen(
        [sys.executable, "-m", "weightsync.cli", "bench", "--hosts", "2", "--receivers", "1", "--model-mb", "4",
         "--bucket-mb", "1", "--repeat", "100", "--backends", "gloo"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "GLOG_minloglevel": "2"})
    prefix = f"wst-{process.pid}-"
    try:
        # Killed once its testbed (a switch and 2 hosts) exists.
        assert wait_until(lambda: len({n for n in netns_names() if n.startswith(prefix)}) == 3, 60), netns_names()
        time.sleep(1.0)  # its workers start in the hosts
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    leftovers = {name for name in netns_names() if name.startswith(prefix)}
    # The negative control: without --cleanup they stay.
    assert len(leftovers) == 3
    result = bench("--cleanup", timeout=90)
    assert result.returncode == 0, result.stderr
    assert not {name for name in netns_names() if name.startswith(prefix)}
    assert all(name in result.stdout for name in leftovers)
    run_folder = pathlib.Path(tempfile.gettempdir()) / next(iter(leftovers)).rsplit("-", 1)[0]
    assert not run_folder.exists()


def test_an_rtt_without_netem_says_why_in_one_line() -> None:
    skip_unless_testbed()
    if probe().netem:
        pytest.skip("this kernel has sch_netem: an RTT is possible here")
    result = bench("--hosts", "2", "--rtt-ms", "5", "--model-mb", "1", "--bucket-mb", "1", "--repeat", "1")
    assert result.returncode == 2
    assert "no testbed on this machine: an RTT needs sch_netem" in result.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--hosts", "1"], "at least 2 hosts"),
    (["--link-gbps", "2"], "need --hosts"),
    (["--rails", "2"], "need --hosts"),
    (["--hosts", "2", "--rails", "9"], "--rails must be 1..8"),
    (["--hosts", "3", "--plot", "x.png"], "do not apply with --hosts"),
])
def test_bad_hosts_options_are_refused(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *args]) == 2
    assert message in capsys.readouterr().err


def test_receivers_are_placed_host_by_host() -> None:
    case = make_case("bucketed", BenchOptions(hosts=4, receivers=2, model_mb=1, bucket_mb=1))
    assert case.receivers == 6
    assert [case.host_of(group_rank) for group_rank in range(7)] == [0, 1, 1, 2, 2, 3, 3]
    local = make_case("bucketed", BenchOptions(receivers=2, model_mb=1, bucket_mb=1))
    assert local.receivers == 2 and [local.host_of(rank) for rank in range(3)] == [0, 0, 0]


@pytest.mark.parametrize(("actor_ranks", "staged", "delta"), [("1", False, False), ("2", True, True)])
def test_rails_are_counted_one_by_one_and_two_actor_ranks_stripe_over_them(tmp_path: pathlib.Path,
                                                                            actor_ranks: str, staged: bool,
                                                                            delta: bool) -> None:
    """``--rails 2``: two links per host, the link limit is both of the sender host's, and every update's bytes are
    read per rail from the switch side; each rail's figures add up to the host's. With two actor ranks (the
    default: one per rail) auto deals the update into two stripes and each rail carries half of it; with one
    (the control), one sender: rail 0 carries the update, rail 1 next to nothing. ``--staged``: the staged entry
    too (each receiver stages the stripe of its rail, both swap from both areas) carries half over each rail.
    ``--delta`` (``--mix rl``): every entry is the manager's, so ``auto+delta`` is dealt what the manager deals a
    delta update — no stripes, its report says so, and its changes cross rail 0 alone. (One run measures both
    ``--staged`` and ``--delta``: its entries are auto, auto+delta, auto+staged and auto+delta+staged.)"""
    skip_unless_testbed()
    out = tmp_path / "rails.json"
    result = bench("--hosts", "2", "--receivers", "2", "--rails", "2", "--actor-ranks", actor_ranks, "--link-gbps",
                   str(LINK_GBPS), "--model-mb", "16", "--bucket-mb", "1", "--repeat", "2", "--backends", "auto",
                   *(["--staged"] if staged else []), *(["--delta", "--mix", "rl"] if delta else []),
                   "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["scenario"]["rails"] == 2 and data["scenario"]["actor_ranks"] == int(actor_ranks)
    assert data["link_limit_gbps"] == pytest.approx(2 * LINK_GBPS / 8)
    assert "2 rails of 1 Gb/s each way" in result.stdout and "host 0 out per rail / S" in result.stdout
    for row in data["results"]:
        assert len(row["rail_egress_bytes"]) == 2 and len(row["rail_ingress_bytes"]) == 1
        assert len(row["rail_ingress_bytes"][0]) == 2
        assert abs(sum(row["rail_egress_bytes"]) - row["sender_egress_bytes"]) <= 2
        assert abs(sum(row["rail_ingress_bytes"][0]) - row["host_ingress_bytes"][0]) <= 2
    for row in data["results"]:  # every engine entry carries the manager's report of its last update
        if row["backend"] not in ("naive", "bucketed"):
            assert row["report"]["chosen"].startswith(row["chosen"]) and row["report"]["stages"]["transfer"] > 0
            assert {outcome["state"] for outcome in row["report"]["replicas"]} == {"committed"}, row["report"]
    if delta:
        dealt = next(row for row in data["results"] if row["backend"] == "auto+delta")
        assert "stripes" not in dealt["report"]["chosen"] and dealt["chosen"].endswith("(two-level)"), dealt
        assert dealt["report"]["changed_fraction"] < 0.2, dealt["report"]["changed_fraction"]
        assert dealt["rail_ingress_bytes"][0][1] < 0.01 * MODEL_BYTES, dealt  # rail 1: next to nothing
        assert dealt["rail_ingress_bytes"][0][0] > dealt["rail_ingress_bytes"][0][1], dealt
    full = [next(row for row in data["results"] if row["backend"] == "auto")]
    if staged:
        full.append(next(row for row in data["results"] if row["backend"] == "auto+staged"))
        assert full[1]["failed_requests"] == 0 and full[1]["stage_seconds"] > 0, full[1]
    for auto in full:
        if actor_ranks == "2":
            assert auto["chosen"].endswith("(two-level, 2 stripes)"), auto
            for rail in (0, 1):
                assert 0.4 * MODEL_BYTES <= auto["rail_egress_bytes"][rail] <= 0.6 * MODEL_BYTES, auto
                assert 0.4 * MODEL_BYTES <= auto["rail_ingress_bytes"][0][rail] <= 0.6 * MODEL_BYTES, auto
        else:
            assert auto["chosen"].endswith("(two-level)"), auto
            assert auto["rail_egress_bytes"][0] >= 0.95 * MODEL_BYTES
            assert auto["rail_egress_bytes"][1] < 0.01 * MODEL_BYTES
