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
from weightsync.cli.testbed import LinkCounters, Testbed, TestbedRay

from tests.tools.testbed.driving import steer
from tests.tools.testbed.support import start_or_skip


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestbedRay]:
    bed = start_or_skip(Testbed(3, link_gbps=2.0, rails=2))
    try:
        with TestbedRay(bed) as ray_cluster:
            yield ray_cluster
    finally:
        bed.close()


def test_auto_sends_one_stripe_over_each_rail(cluster: TestbedRay) -> None:
    marks: dict[str, tuple[tuple[LinkCounters, ...], ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = cluster.bed.rail_counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    # 1 MiB buckets: 28 of them, dealt alternately over the two stripes.
    placement = json.dumps({"actor_ranks": 2, "replicas": [["2", "2"]], "bucket_mb": 1})
    result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.across_hosts_driver", nodes, "auto",
                             placement], on_request)
    assert result["first"] and result["ok"]
    assert result["digests"] == [result["expected"]] * 2  # what each worker holds, hashed in its own process
    assert "(two-level, 2 stripes)" in result["chosen"], result
    assert result["senders"] == 2  # both actor ranks sent a part
    moved = [[after - before for before, after in zip(host_before, host_after)]
             for host_before, host_after in zip(marks["before"], marks["after"])]
    size = result["nbytes"]
    for rail in (0, 1):  # each rail of the sender's host out, and of the receiving host in: half the model each
        assert 0.45 * size <= moved[1][rail].egress_bytes <= 0.65 * size, moved
        assert 0.45 * size <= moved[2][rail].ingress_bytes <= 0.65 * size, moved
