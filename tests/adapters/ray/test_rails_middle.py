"""A middle rail lost: a testbed of three hosts with three rails each, an actor worker group of three ranks on
host 1 and a replica of three workers on host 2, ``backend="auto"`` (three stripes). Rail 1 of the receiving host
is cut mid-update: the update fails naming rail 1, and the next one, the rail still down, is dealt over rails 0 and
2 (two stripes, not one), by the rails' own counters (read outside every host); once rail 1 answers again, over all
three.
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
    bed = start_or_skip(Testbed(3, link_gbps=2.0, rails=3))
    try:
        with TestbedRay(bed) as ray_cluster:
            yield ray_cluster
    finally:
        bed.close()


def test_a_lost_middle_rail_leaves_the_stripes_on_either_side_of_it(cluster: TestbedRay) -> None:
    marks: dict[str, tuple[tuple[LinkCounters, ...], ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        if "cut" in message:
            cluster.bed.link_down(2, rail=1, mode=message["cut"])
        elif "restore" in message:
            cluster.bed.link_up(2, rail=1)
        else:
            marks[message["mark"]] = cluster.bed.rail_counters()

    nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
    try:
        result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.rail_fault_driver", nodes, "drop",
                                 json.dumps({"rails": 3})], on_request)
    finally:
        cluster.bed.link_up(2)
    assert result["first"] and "(two-level, 3 stripes)" in result["chosen"], result
    faulted = result["faulted"]
    assert faulted["error"] == "TransferError" and "over rail 1 from host wst-h1 to host wst-h2" in faulted["message"]
    down, restored = result["down"], result["restored"]
    assert down["ok"] and down["whole"], down
    assert "(two-level, 2 stripes: rails 0, 2)" in down["chosen"] and "rail 1 left out" in down["chosen"], down
    moved = [[after - before for before, after in zip(then, now)]
             for then, now in zip(marks["down before"], marks["down after"])]
    size = down["nbytes"]
    for rail in (0, 2):  # the two stripes, half the model each, into the receiving host and out of the sender's
        assert 0.4 * size <= moved[2][rail].ingress_bytes <= 0.65 * size, moved
        assert 0.4 * size <= moved[1][rail].egress_bytes <= 0.65 * size, moved
    assert moved[2][1].ingress_bytes < 0.05 * size, moved  # the lost rail: idle
    assert restored["ok"] and restored["whole"] and "(two-level, 3 stripes)" in restored["chosen"], restored
