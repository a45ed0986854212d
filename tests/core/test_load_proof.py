"""The manager's proof of load: replicas' own checksums compared per parameter (``LoadProvingReplica``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from weightsync.api.errors import LoadVerificationError
from weightsync.api.protocols import LoadProvingReplica
from weightsync.core import CheckpointEngineManager
from weightsync.core.control.replicas import disagreeing


def test_a_replica_that_differs_from_the_majority_is_named_with_its_first_parameter() -> None:
    same = {"a": "1", "b": "2", "c": "3"}
    assert disagreeing([(0, same), (1, dict(same)), (2, {**same, "c": "x", "b": "y"})]) == {2: "b"}
    assert disagreeing([(0, same), (1, dict(same)), (2, dict(same))]) == {}  # control: nothing to report


def test_without_a_majority_every_replica_involved_is_named() -> None:
    assert disagreeing([(0, {"a": "1"}), (1, {"a": "2"})]) == {0: "a", 1: "a"}


def test_a_parameter_one_replica_lacks_counts_as_different() -> None:
    assert disagreeing([(0, {"a": "1", "b": "2"}), (1, {"a": "1", "b": "2"}), (4, {"a": "1"})]) == {4: "b"}


class _Group:
    world_size = 1

    def execute_checkpoint_engine(self, method: str, /, **per_rank_kwargs: Sequence[Any]) -> list[Any]:
        raise AssertionError("not called by verify_loads")

    def update_weights(self, *, version: int) -> list[Any]:
        raise AssertionError("not called by verify_loads")


class _Replica:
    def __init__(self, checksums: Mapping[str, str]) -> None:
        self.checksums = dict(checksums)
        self.workers: list[Any] = [object()]

    async def weight_checksums(self) -> Mapping[str, str]:
        return self.checksums

    async def abort_all_requests(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume_generation(self) -> None: ...


def test_verify_loads_names_the_replica_and_the_parameter() -> None:
    replicas = [_Replica({"w": "1", "v": "2"}), _Replica({"w": "1", "v": "2"}), _Replica({"w": "1", "v": "9"})]
    assert all(isinstance(replica, LoadProvingReplica) for replica in replicas)
    manager = CheckpointEngineManager(backend="shm", actor_wg=_Group(), replicas=replicas)
    with pytest.raises(LoadVerificationError) as caught:
        asyncio.run(manager.verify_loads())
    assert caught.value.details == {"replica": "replica2", "parameter": "v"}
    replicas[2].checksums["v"] = "2"
    asyncio.run(manager.verify_loads())  # control: equal checksums pass
