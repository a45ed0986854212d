"""The shared chain topology (no transfer library involved) and its typed failures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.backends.twolevel import HOSTS, LEADER_OF, check_in_place

from weightsync.api.errors import TopologyError
from weightsync.api.testing import EngineHarness
from weightsync.api.types import WorkerMetadata, WorldMetadata
from weightsync.core.backend import BucketCheckpointEngine
from weightsync.core.transports.chain.plan import ChainPlans
from weightsync.core.transports.plan import decode_plan
from weightsync.core.transports.chain.transport import chain_positions
from weightsync.core.transports.chain.topology import plan_positions
from weightsync.mooncake.engine import MooncakeCheckpointEngine
from weightsync.nixl.engine import NixlCheckpointEngine


def test_chain_and_trees() -> None:
    assert chain_positions(rollout_world_size=3, fanout=1) == [[1], [2], [3], []]
    assert chain_positions(rollout_world_size=4, fanout=2) == [[1, 2], [3, 4], [], [], []]
    assert chain_positions(rollout_world_size=3, fanout=3) == [[1, 2, 3], [], [], []]
    assert chain_positions(rollout_world_size=0, fanout=1) == [[]]


def _library(engine: type[BucketCheckpointEngine]) -> str:
    return str(getattr(engine.transport_class, "library"))


def _metadata(library: str, rollout: int, fanout: int = 1) -> WorldMetadata:
    actor: list[WorkerMetadata] = [{"address": "10.0.0.1:100", "fanout": fanout, "library": library}, {}]
    workers: list[WorkerMetadata] = [{"address": f"10.0.0.{2 + j}:100", "fanout": fanout, "library": library}
                                     for j in range(rollout)]
    return WorldMetadata(actor=actor, rollout=workers)


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_build_topology_is_a_chain_by_rank(engine: type[BucketCheckpointEngine]) -> None:
    topology = engine.build_topology(actor_wg_world_size=2, rollout_world_size=3,
                                     metadata=_metadata(_library(engine), 3))
    topology.check(actor_wg_world_size=2, rollout_world_size=3)
    assert topology.senders == (0,)
    actor = [decode_plan(args, ChainPlans, who="test") for args in topology.actor]
    rollout = [decode_plan(args, ChainPlans, who="test") for args in topology.rollout]
    assert [plan.role for plan in actor] == ["sender", "idle"]
    assert actor[0].children == (1,)
    assert [plan.source.upstream for plan in rollout] == ["10.0.0.1:100", "10.0.0.2:100", "10.0.0.3:100"]
    assert [plan.source.children for plan in rollout] == [(2,), (3,), ()]


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_build_topology_rejects_foreign_metadata(engine: type[BucketCheckpointEngine]) -> None:
    other = "mooncake" if _library(engine) == "nixl" else "nixl"
    with pytest.raises(TopologyError, match="rollout rank 1 did not advertise"):
        metadata = _metadata(_library(engine), 3)
        engine.build_topology(actor_wg_world_size=2, rollout_world_size=3, metadata=WorldMetadata(
            actor=metadata.actor, rollout=[metadata.rollout[0], {"library": other, "address": "x:1"},
                                           metadata.rollout[2]]))
    with pytest.raises(TopologyError, match="rollout_world_size=4"):
        engine.build_topology(actor_wg_world_size=2, rollout_world_size=4, metadata=_metadata(_library(engine), 3))


_UNREACHABLE = """
import json, socket, sys
from weightsync.api.errors import TransferError
from weightsync.api.types import WorkerContext
from weightsync.{module}.engine import {engine} as Engine

with socket.socket() as probe:  # a port nobody listens on
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
receiver = Engine(bucket_bytes=1 << 16, timeout=5.0, context=WorkerContext(role="rollout", rank=1, node_id="n"))
outcome = {{}}
try:
    receiver.prepare()
    try:
        receiver.init_process_group(rank_args={{
            "kind": "chain-receive", "epoch": "e" * 32, "rank": 1,
            "source": {{"upstream": f"127.0.0.1:{{port}}", "upstream_position": 1}},
        }})
    except TransferError as exc:
        outcome = {{"type": type(exc).__name__, "peer": exc.peer, "message": str(exc)}}
finally:
    receiver.close()
    receiver.close()  # idempotent
print(json.dumps(outcome), flush=True)
"""


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_unreachable_upstream_is_a_transfer_error_naming_it(
    engine: type[BucketCheckpointEngine],
) -> None:
    # In a child process: NIXL 1.5.1 crashes during interpreter teardown in any process that created an agent
    # (see packages/weightsync-nixl/README.md), which would turn pytest's own exit status into a segfault.
    code = _UNREACHABLE.format(module=_library(engine), engine=engine.__name__)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stdout + result.stderr
    outcome = json.loads(lines[-1])
    assert outcome["type"] == "TransferError" and outcome["peer"] == "rollout rank 0", outcome
    assert "rollout rank 0" in outcome["message"]


def test_two_level_plan() -> None:
    # Hosts a (the sender's), b, c; rank order interleaves them.
    plan = plan_positions(nodes=["a", "a", "b", "b", "c", "b"], fanout=1, layout="two_level")
    assert plan.upstream == [-1, 0, 0, 2, 2, 2]  # leaders 0 → 2 → 4; 1 reads 0 in place; 3 and 5 read 2
    assert plan.local == [False, True, False, True, False, True]
    assert plan.children == [[1, 2], [], [3, 4, 5], [], [], []]
    tree = plan_positions(nodes=["a", "b", "c", "d", "b"], fanout=2, layout="two_level")
    assert tree.upstream == [-1, 0, 0, 1, 1]  # leaders 1 and 2 read the sender; 3 reads leader 1
    assert tree.local == [False, False, False, False, True]
    one_host = plan_positions(nodes=["a", "a", "a"], fanout=1, layout="two_level")
    assert one_host.upstream == [-1, 0, 0] and one_host.local == [False, True, True]  # the shm layout
    chain = plan_positions(nodes=["a", "b", "a"], fanout=1, layout="chain")
    assert chain.upstream == [-1, 0, 1] and chain.local == [False] * 3


def test_in_place_checker_fails_on_the_plain_chain() -> None:
    """Negative control for tests/backends/twolevel.py: the plain chain on the same pretend hosts maps no ring."""
    harness = EngineHarness("mooncake", receivers=4, bucket_bytes=1 << 20, hosts=HOSTS)
    harness.start()
    try:
        harness.setup()
        harness.update("three_buckets")
        with pytest.raises(AssertionError):
            check_in_place(harness.pids, LEADER_OF)
    finally:
        harness.close()


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_two_level_topology_names_the_children_that_read_in_place(engine: type[BucketCheckpointEngine]) -> None:
    # Those children wait for whole buckets, so a position whose children all read in place reads in one go and
    # announces no pieces; a leader with a network child (host b's, read by host c's) relays piece by piece.
    metadata = _metadata(_library(engine), 4)
    nodes = ["a", "b", "b", "c", "c"]
    metadata = WorldMetadata(
        actor=[{**metadata.actor[0], "layout": "two_level", "node_id": nodes[0]}, {}],
        rollout=[{**worker, "node_id": node} for worker, node in zip(metadata.rollout, nodes[1:])])
    topology = engine.build_topology(actor_wg_world_size=2, rollout_world_size=4, metadata=metadata)
    sender = decode_plan(topology.actor[0], ChainPlans, who="test")
    rollout = [decode_plan(args, ChainPlans, who="test") for args in topology.rollout]
    assert sender.children == (1,) and sender.in_place == ()
    assert [plan.source.children for plan in rollout] == [(2, 3), (), (4,), ()]
    assert [plan.source.in_place for plan in rollout] == [(2,), (), (4,), ()]
