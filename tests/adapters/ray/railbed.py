"""What the rails tests share: a testbed of three hosts with K rails each and a raylet in each, and a rail of
host 2 cut mid-update (``rail_fault_driver``), the rails' counters read around the update after the cut."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from weightsync.testbed import LinkCounters, Testbed, TestbedRay

from tests.tools.testbed.driving import steer
from tests.tools.testbed.support import start_or_skip


def rail_cluster(rails: int) -> Iterator[TestbedRay]:
    """A module fixture's body: the testbed and its Ray cluster, removed after the module."""
    bed = start_or_skip(Testbed(3, link_gbps=2.0, rails=rails))
    try:
        with TestbedRay(bed) as ray_cluster:
            yield ray_cluster
    finally:
        bed.close()


def rail_fault(cluster: TestbedRay, mode: str, options: dict[str, Any]
               ) -> tuple[dict[str, Any], list[list[LinkCounters]]]:
    """Run ``rail_fault_driver`` (``options``: its JSON argument), cutting rail 1 of host 2 when it asks (``mode``:
    drop or carrier) and restoring it when it asks; its result, and what each rail of each host carried in the
    update after the cut (the rail still down)."""
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
        result = steer(cluster, [sys.executable, "-m", "tests.adapters.ray.rail_fault_driver", nodes, mode,
                                 json.dumps(options)], on_request)
    finally:
        cluster.bed.link_up(2)
    moved = [[after - before for before, after in zip(then, now)]
             for then, now in zip(marks["down before"], marks["down after"])]
    return result, moved
