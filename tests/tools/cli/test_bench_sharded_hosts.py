"""`weightsync bench --hosts 3 --actor-ranks 2 --sharded --rails 2` as a user runs it: a real testbed (network
namespaces, two shaped links per host), two actor ranks on host 0 holding the bench's model under FSDP2 over gloo
(one per rail), each sending its shards over a two-level chain of its own, against the same ranks holding the whole
model, which auto stripes over the rails. A small model on fast links: what is checked is who sent what (the senders'
reports and the link counters, read from the switch side of every rail), that every receiver holds the model sent,
and that the reported ratio is the one the timings give. No timing assertions: the machine is shared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

import pytest

from tests.tools.testbed.support import skip_unless_testbed

MODEL_BYTES = 16 * 2**20
HALF = (0.4 * MODEL_BYTES, 0.6 * MODEL_BYTES)


@pytest.fixture(scope="module")
def sharded_hosts_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    skip_unless_testbed()
    out = tmp_path_factory.mktemp("bench-sharded-hosts") / "sharded-hosts.json"
    # --backends left out: across hosts --sharded defaults to auto, the one backend that picks two-level chains.
    result = subprocess.run([sys.executable, "-m", "weightsync.cli", "bench", "--hosts", "3", "--actor-ranks", "2",
                             "--sharded", "--rails", "2", "--model-mb", "16", "--bucket-mb", "4", "--repeat", "1",
                             "--link-gbps", "20", "--json", str(out)],
                            capture_output=True, text=True, timeout=240,
                            env={**os.environ, "GLOG_minloglevel": "2"}, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text()), result.stdout


def test_each_rank_sends_half_the_model_over_its_own_rail(sharded_hosts_run: tuple[dict[str, Any], str]) -> None:
    data, _ = sharded_hosts_run
    rows = {row["backend"]: row for row in data["results"]}
    assert list(rows) == ["auto", "auto+sharded", "naive", "bucketed"]
    scenario = data["scenario"]
    assert scenario["sharded"] is True and scenario["actor_ranks"] == 2 and scenario["rails"] == 2
    total = scenario["model_bytes"]
    assert abs(total - MODEL_BYTES) < 2**20
    for name in ("auto", "auto+sharded"):
        row = rows[name]
        # committed: every receiver's digest of every stream matched what was sent
        assert [outcome["state"] for outcome in row["report"]["replicas"]] == ["committed"] * 4, row["report"]
        # every receiving host took in the whole model (both halves), and host 0 sent it once, half on each rail
        assert all(nbytes >= 0.95 * total for nbytes in row["host_ingress_bytes"]), row
        assert all(HALF[0] <= nbytes <= HALF[1] for nbytes in row["rail_egress_bytes"]), row
    sharded = rows["auto+sharded"]
    assert sharded["receivers_checked"] == 4  # every receiver's whole model compared with the version sent
    senders = sorted((t for t in sharded["report"]["transfers"] if t["role"] == "actor"), key=lambda t: t["rank"])
    assert [t["rank"] for t in senders] == [0, 1]
    assert sharded["actor_bytes"] == [t["nbytes"] for t in senders] and sum(sharded["actor_bytes"]) == total
    assert all(HALF[0] <= nbytes <= HALF[1] for nbytes in sharded["actor_bytes"]), sharded["actor_bytes"]
    # rank r on rail r: its rail's egress counter is its own egress
    assert sharded["actor_egress_fraction"] == [round(nbytes / total, 4) for nbytes in sharded["rail_egress_bytes"]]
    assert all(0.4 <= fraction <= 0.6 for fraction in sharded["actor_egress_fraction"]), sharded
    assert "auto+gathered" not in rows and "actor_bytes" not in rows["auto"]


def test_ratio_is_sharded_over_striped_and_is_printed(sharded_hosts_run: tuple[dict[str, Any], str]) -> None:
    data, stdout = sharded_hosts_run
    row = next(row for row in data["results"] if row["backend"] == "auto+sharded")
    seconds = data["scenario"]["seconds"]
    assert row["striped"] == "auto"
    assert row["ratio_sharded_striped"] == pytest.approx(
        statistics.median(seconds["auto+sharded"]) / statistics.median(seconds["auto"]), rel=1e-3)
    assert f"auto+sharded / auto = {row['ratio_sharded_striped']:.2f} x (update time, p50;" in stdout
    assert "each rank's egress within 0.45-0.55 x S" in stdout
    assert "2 actor ranks on host 0 hold the model under FSDP2" in stdout
