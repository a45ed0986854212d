"""A sharded trainer under verl: two actor ranks hold an FSDP2-sharded model and export their shards as verl 0.9's
engines do (``get_per_tensor_param_shard``: ``(name, local shard, ShardSpec)``); ``WeightsyncActorMixin.weight_shards``
hands them to weightsync, which sends each rank's shards as they are, never gathered, under weightsync's drop-in
manager and under verl's own."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineManager as VerlManager  # noqa: E402
from weightsync.verl import CheckpointEngineManager  # noqa: E402

from tests.adapters.verl.conftest import VerlWorld  # noqa: E402
from tests.adapters.verl.workloads import mismatches, model_weights  # noqa: E402

MODEL_BYTES = sum(tensor.nbytes for _, tensor in model_weights(0))


def test_each_rank_sends_the_shards_verl_exports_under_weightsyncs_manager(verl_sharded_world: VerlWorld) -> None:
    world = verl_sharded_world
    manager = CheckpointEngineManager(config=world.config, actor_wg=world.actor_wg, replicas=world.replicas)
    for step in (3, 4):
        world.set_model(step)
        manager.update_weights(step)
        report = manager.last_report
        assert report is not None and report.ok, report
        sent = sorted(transfer.nbytes for transfer in report.transfers if transfer.role == "actor")
        assert len(sent) == 2 and sum(sent) == MODEL_BYTES and sent[0] > 0.45 * MODEL_BYTES, sent  # each its half
        for tensors, _ in world.received():
            assert mismatches(tensors, model_weights(step)) == []


def test_verls_own_manager_sends_the_shards_too(verl_sharded_world: VerlWorld) -> None:
    """verl's manager runs prepare → build_topology (weightsync's, through the registry) → init → update_weights on
    every rank (``ONE_TO_ALL``): every rank sends its shards, and the rollout's server adapter gets the model."""
    world = verl_sharded_world
    manager = VerlManager(config=world.config, actor_wg=world.actor_wg, replicas=world.replicas)
    world.set_model(5)
    result = manager.update_weights(global_steps=5)  # verl runs its coroutine itself outside an event loop
    if asyncio.iscoroutine(result):
        asyncio.run(result)
    for tensors, _ in world.received():
        assert mismatches(tensors, model_weights(5)) == []
