"""verl's own CheckpointEngineManager and CheckpointEngineWorker moving weights with a weightsync backend that verl
found through ``custom_backend_module=weightsync.verl`` — configuration only, no weightsync code on verl's path."""

from __future__ import annotations

import asyncio
import importlib

import pytest

pytest.importorskip("verl")

from tests.adapters.verl.conftest import BACKEND, VerlWorld  # noqa: E402
from tests.adapters.verl.workloads import BUCKET_BYTES, mismatches, model_weights, raw  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager as VerlManager  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402
from verl.utils.import_utils import import_external_libs  # noqa: E402
from weightsync.api.errors import ConfigError, TopologyError  # noqa: E402
from weightsync.api.registry import installed_backends  # noqa: E402
from weightsync.core.transports.plan import decode_plan  # noqa: E402
from weightsync.shm.engine import ShmTransport  # noqa: E402


def test_every_installed_backend_is_registered_and_reimport_is_harmless() -> None:
    import weightsync.verl
    import weightsync.verl.engine

    expected = {f"weightsync.{name}" for name in installed_backends()}
    assert expected == {"weightsync.shm", "weightsync.gloo", "weightsync.tcp"}  # the verl env's backends
    before = {name: CheckpointEngineRegistry.get(name) for name in expected}
    import_external_libs("weightsync.verl")  # what verl does in every process
    importlib.reload(weightsync.verl.engine)  # a real second execution of the registering code
    importlib.reload(weightsync.verl)
    after = {name: CheckpointEngineRegistry.get(name) for name in expected}
    assert after == before
    assert all(cls.backend == name.removeprefix("weightsync.") for name, cls in after.items())


def test_a_foreign_class_under_our_name_is_refused() -> None:
    from weightsync.verl.engine import register_backends

    saved = CheckpointEngineRegistry._registry["weightsync.gloo"]
    CheckpointEngineRegistry._registry["weightsync.gloo"] = object
    try:
        with pytest.raises(ConfigError, match="already taken"):
            register_backends()
    finally:
        CheckpointEngineRegistry._registry["weightsync.gloo"] = saved


def test_build_topology_takes_verls_positional_call() -> None:
    engine_class = CheckpointEngineRegistry.get(BACKEND)
    node = {"node_id": "host-a"}
    metadata = [{**node, "address": "weightsync-shm-test"}, dict(node), dict(node), dict(node)]
    actor_kwargs, rollout_kwargs = engine_class.build_topology(2, 2, metadata)
    actor = [decode_plan(args, ShmTransport.plans, who="test") for args in actor_kwargs["rank_args"]]
    rollout = [decode_plan(args, ShmTransport.plans, who="test") for args in rollout_kwargs["rank_args"]]
    assert [plan.role for plan in actor] == ["sender", "idle"]
    assert [plan.rank for plan in rollout] == [0, 1]
    epochs = {plan.epoch for plan in [*actor, *rollout]}
    assert len(epochs) == 1
    with pytest.raises(TopologyError, match="metadata for 3 workers"):
        engine_class.build_topology(2, 2, metadata[:3])
    with pytest.raises(TopologyError, match="within one host"):
        engine_class.build_topology(1, 1, [metadata[0], {"node_id": "host-b"}])


def test_the_bit_exact_checker_can_fail() -> None:
    expected = model_weights(1)
    received = {name: raw(tensor) for name, tensor in expected}
    assert mismatches(received, expected) == []
    name, (dtype, shape, data) = next(iter(received.items()))
    flipped = dict(received)
    flipped[name] = (dtype, shape, bytes([data[0] ^ 1]) + data[1:])
    assert mismatches(flipped, expected) == [f"{name}: bytes differ (first at 0)"]
    missing = {key: value for key, value in received.items() if key != name}
    assert mismatches(missing, expected) == [f"{name}: missing"]
    retyped = dict(received)
    retyped[name] = ("float16", shape, data)
    assert len(mismatches(retyped, expected)) == 1
    assert mismatches(received, model_weights(2))  # another version differs everywhere


def test_verls_own_manager_moves_weights_bit_exact(verl_world: VerlWorld) -> None:
    largest = max(tensor.numel() * tensor.element_size() for _, tensor in model_weights(0))
    assert largest > BUCKET_BYTES  # one tensor is split across buckets and merged back
    manager = VerlManager(config=verl_world.config, actor_wg=verl_world.actor_wg, replicas=verl_world.replicas)
    for step in (3, 4, 5):
        verl_world.set_model(step)
        # The PPO trainer's call: synchronous, positional (verl's @auto_await runs it to completion).
        metrics = manager.update_weights(step)
        assert metrics["weightsync/send_bytes"] == sum(t.numel() * t.element_size() for _, t in model_weights(step))
        received = verl_world.received()
        assert len(received) == 3  # two replicas: two workers, then one
        for tensors, updates in received:
            assert mismatches(tensors, model_weights(step)) == []
            assert updates[-1]["global_steps"] == step
            assert updates[-1]["wire_format"] == "named_tensors"


def test_verls_own_manager_awaited(verl_world: VerlWorld) -> None:
    manager = VerlManager(config=verl_world.config, actor_wg=verl_world.actor_wg, replicas=verl_world.replicas)
    verl_world.set_model(8)

    async def fully_async_trainer() -> None:
        await manager.update_weights(global_steps=8)

    asyncio.run(fully_async_trainer())
    for tensors, _ in verl_world.received():
        assert mismatches(tensors, model_weights(8)) == []
