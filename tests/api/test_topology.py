"""weightsync.api.topology: epoch stamping and the checked topology every driver builds."""

from __future__ import annotations

from typing import Any

import pytest

from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.topology import build_checked_topology, with_epoch
from weightsync.api.types import RankArgs, Topology, WorldMetadata


def _world(actors: int, rollouts: int) -> WorldMetadata:
    return WorldMetadata(actor=[{"rank": i} for i in range(actors)], rollout=[{"rank": j} for j in range(rollouts)])


class _Engine:
    """A stand-in engine class whose build_topology returns (or raises) what a test sets."""

    result: Any = None

    @classmethod
    def build_topology(cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata) -> Any:
        if isinstance(cls.result, BaseException):
            raise cls.result
        return cls.result


def _build(result: Any, actors: int = 2, rollouts: int = 1, world: WorldMetadata | None = None) -> Topology:
    engine: Any = type("Engine", (_Engine,), {"result": result})
    return build_checked_topology(engine, backend="stub", actor_wg_world_size=actors, rollout_world_size=rollouts,
                                  metadata=world if world is not None else _world(actors, rollouts))


def test_with_epoch_stamps_one_fresh_token_and_keeps_existing_ones() -> None:
    actor: list[RankArgs] = [{"rank": 0}, {"rank": 1, "epoch": "kept"}]
    topology = Topology(actor=actor, rollout=[{"rank": 0}], senders=(1,))
    stamped = with_epoch(topology)
    token = stamped.actor[0]["epoch"]
    assert isinstance(token, str) and len(token) == 32
    assert stamped.rollout[0]["epoch"] == token and stamped.actor[1]["epoch"] == "kept"
    assert stamped.senders == (1,) and "epoch" not in topology.actor[0]  # the input is not modified
    assert with_epoch(topology).actor[0]["epoch"] != token  # each call starts a new epoch


def test_a_good_topology_passes() -> None:
    topology = Topology(actor=[{}, {}], rollout=[{}])
    assert _build(topology) is topology


@pytest.mark.parametrize(("result", "match"), [
    (Topology(actor=[{}], rollout=[{}]), "1 actor entries but actor_wg_world_size is 2"),
    (Topology(actor=[{}, {}], rollout=[{}], senders=(2,)), "senders"),
    ({"actor": [], "rollout": []}, "stub.build_topology returned dict, not Topology"),
    (KeyError("address"), "stub.build_topology failed: KeyError"),
])
def test_a_bad_topology_is_a_topology_error_naming_the_backend(result: Any, match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        _build(result)


def test_typed_errors_pass_through() -> None:
    error = ConfigError("shared memory across nodes")
    with pytest.raises(ConfigError) as caught:
        _build(error)
    assert caught.value is error


def test_sizes_and_metadata_are_checked_before_the_engine_is_asked() -> None:
    good = Topology(actor=[{}, {}], rollout=[{}])
    with pytest.raises(TopologyError, match="actor_wg_world_size must be a non-negative int"):
        _build(good, actors=-1, world=_world(0, 1))
    with pytest.raises(TopologyError, match="rollout_world_size=1 but metadata holds 2 rollout entries"):
        _build(good, world=_world(2, 2))
