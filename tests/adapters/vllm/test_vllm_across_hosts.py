"""weightsync into real vLLM across hosts: ``backend="auto"`` on the emulated testbed (a Ray cluster with a raylet
in each host), the actor worker group on one host and a vLLM replica on each of two others. After every update each
replica holds what the reference engine (the module fixture's, outside the testbed) loads from that version's
checkpoint — vLLM's checksums and greedy top-5 logprobs — and the link counters, read outside every host, show the
model entered each replica's host over its link."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

import ray  # noqa: E402

from tests.adapters.vllm.conftest import Serving  # noqa: E402
from tests.adapters.vllm.workloads import PROMPTS  # noqa: E402
from tests.tools.testbed.driving import steer  # noqa: E402
from tests.tools.testbed.support import start_or_skip  # noqa: E402
from weightsync.testbed import LinkCounters, Testbed, TestbedRay  # noqa: E402


def test_auto_across_two_hosts_matches_the_reference(serving: Serving) -> None:
    bed = start_or_skip(Testbed(4, link_gbps=2.0))
    marks: dict[str, tuple[LinkCounters, ...]] = {}

    def on_request(message: dict[str, Any]) -> None:
        marks[message["mark"]] = bed.counters()

    try:
        with TestbedRay(bed) as cluster:
            nodes = json.dumps({str(index): node for index, node in enumerate(cluster.node_ids)})
            result = steer(cluster, [sys.executable, "-m", "tests.adapters.vllm.across_hosts_driver", nodes,
                                     str(serving.checkpoints)], on_request)
    finally:
        bed.close()
    previous: list[list[int]] | None = None
    for step in result["steps"]:
        assert step["states"] == ["committed", "committed"], step
        assert step["chosen"], step  # auto made a choice, and says which
        serving.run(serving.reference.call("reload", step["path"]))
        expected = [ray.get(serving.reference.generate(p, max_tokens=6, logprobs=5)) for p in PROMPTS]
        sums = serving.run(serving.reference.vllm_checksums())
        for served in step["served"]:
            assert served["version"] == str(step["version"])
            assert [o["token_ids"] for o in served["outputs"]] == [o["token_ids"] for o in expected]
            assert [o["logprobs"] for o in served["outputs"]] == [o["logprobs"] for o in expected]
            assert served["checksums"] == sums
        tokens = [o["token_ids"] for o in expected]
        assert tokens != previous  # consecutive versions differ in a greedy token: the comparison can tell them apart
        previous = tokens
    moved = [after - before for before, after in zip(marks["before"], marks["after"])]
    size = result["steps"][1]["nbytes"]
    assert moved[1].egress_bytes >= 0.95 * size, moved  # the model left the actor worker group's host
    for host in (2, 3):
        assert moved[host].ingress_bytes >= 0.95 * size, moved  # and entered each replica's host over its link

