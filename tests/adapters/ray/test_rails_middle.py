"""A middle rail lost: a testbed of three hosts with three rails each, an actor worker group of three ranks on
host 1 and a replica of three workers on host 2, ``backend="auto"`` (three stripes). Rail 1 of the receiving host
is cut mid-update: the update fails naming rail 1, and the next one, the rail still down, is dealt over rails 0 and
2 (two stripes, not one), by the rails' own counters (read outside every host); once rail 1 answers again, over all
three.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from weightsync.testbed import TestbedRay

from tests.adapters.ray.railbed import rail_cluster, rail_fault


@pytest.fixture(scope="module")
def cluster() -> Iterator[TestbedRay]:
    yield from rail_cluster(3)


def test_a_lost_middle_rail_leaves_the_stripes_on_either_side_of_it(cluster: TestbedRay) -> None:
    result, moved = rail_fault(cluster, "drop", {"rails": 3})
    assert result["first"] and "(two-level, 3 stripes)" in result["chosen"], result
    faulted = result["faulted"]
    assert faulted["error"] == "TransferError" and "over rail 1 from host wst-h1 to host wst-h2" in faulted["message"]
    down, restored = result["down"], result["restored"]
    assert down["ok"] and down["whole"], down
    assert "(two-level, 2 stripes: rails 0, 2)" in down["chosen"] and "rail 1 left out" in down["chosen"], down
    size = down["nbytes"]
    for rail in (0, 2):  # the two stripes, half the model each, into the receiving host and out of the sender's
        assert 0.4 * size <= moved[2][rail].ingress_bytes <= 0.65 * size, moved
        assert 0.4 * size <= moved[1][rail].egress_bytes <= 0.65 * size, moved
    assert moved[2][1].ingress_bytes < 0.05 * size, moved  # the lost rail: idle
    assert restored["ok"] and restored["whole"] and "(two-level, 3 stripes)" in restored["chosen"], restored
