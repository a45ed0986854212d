"""The shared chain topology (no transfer library involved) and its typed failures."""

from __future__ import annotations

import socket

import pytest

from weightsync.api.errors import TopologyError, TransferError
from weightsync.api.types import WorkerMetadata, WorldMetadata
from weightsync.core.chain import chain_positions
from weightsync.mooncake.engine import MooncakeCheckpointEngine
from weightsync.nixl.engine import NixlCheckpointEngine


def test_chain_and_trees() -> None:
    assert chain_positions(rollout_world_size=3, fanout=1) == [[1], [2], [3], []]
    assert chain_positions(rollout_world_size=4, fanout=2) == [[1, 2], [3, 4], [], [], []]
    assert chain_positions(rollout_world_size=3, fanout=3) == [[1, 2, 3], [], [], []]
    assert chain_positions(rollout_world_size=0, fanout=1) == [[]]


def _metadata(library: str, rollout: int, fanout: int = 1) -> WorldMetadata:
    actor: list[WorkerMetadata] = [{"address": "10.0.0.1:100", "fanout": fanout, "library": library}, {}]
    workers: list[WorkerMetadata] = [{"address": f"10.0.0.{2 + j}:100", "fanout": fanout, "library": library} for j in range(rollout)]
    return WorldMetadata(actor=actor, rollout=workers)


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_build_topology_is_a_chain_by_rank(engine: type[NixlCheckpointEngine | MooncakeCheckpointEngine]) -> None:
    topology = engine.build_topology(actor_wg_world_size=2, rollout_world_size=3,
                                     metadata=_metadata(engine.library, 3))
    topology.check(actor_wg_world_size=2, rollout_world_size=3)
    assert topology.senders == (0,)
    assert [args["role"] for args in topology.actor] == ["sender", "idle"]
    assert topology.actor[0]["children"] == [1]
    assert [args["upstream"] for args in topology.rollout] == ["10.0.0.1:100", "10.0.0.2:100", "10.0.0.3:100"]
    assert [args["children"] for args in topology.rollout] == [[2], [3], []]


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_build_topology_rejects_foreign_metadata(engine: type[NixlCheckpointEngine | MooncakeCheckpointEngine]) -> None:
    other = "mooncake" if engine.library == "nixl" else "nixl"
    with pytest.raises(TopologyError, match="rollout rank 1 did not advertise"):
        metadata = _metadata(engine.library, 3)
        engine.build_topology(actor_wg_world_size=2, rollout_world_size=3, metadata=WorldMetadata(
            actor=metadata.actor, rollout=[metadata.rollout[0], {"library": other, "address": "x:1"},
                                           metadata.rollout[2]]))
    with pytest.raises(TopologyError, match="rollout_world_size=4"):
        engine.build_topology(actor_wg_world_size=2, rollout_world_size=4, metadata=_metadata(engine.library, 3))


@pytest.mark.parametrize("engine", [NixlCheckpointEngine, MooncakeCheckpointEngine])
def test_unreachable_upstream_is_a_transfer_error_naming_it(
    engine: type[NixlCheckpointEngine | MooncakeCheckpointEngine],
) -> None:
    from weightsync.api.types import WorkerContext

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    receiver = engine(bucket_bytes=1 << 16, timeout=5.0,
                      context=WorkerContext(role="rollout", rank=1, node_id="n"))
    try:
        receiver.prepare()
        with pytest.raises(TransferError, match="rollout rank 0") as caught:
            receiver.init_process_group(rank_args={
                "role": "receiver", "epoch": "e" * 32, "rank": 1, "upstream": f"127.0.0.1:{port}",
                "upstream_position": 1, "children": [],
            })
        assert caught.value.peer == "rollout rank 0"
    finally:
        receiver.close()
        receiver.close()  # idempotent
