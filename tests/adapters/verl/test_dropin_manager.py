"""weightsync's drop-in manager, loaded by verl's FQN loader and called exactly as verl 0.9.1's trainers call it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl")

from verl.checkpoint_engine import CheckpointEngineManager as VerlManager  # noqa: E402
from verl.utils.import_utils import load_class_from_fqn  # noqa: E402
from weightsync.api.errors import ConfigError, RenamedKeywordError, StepTimeoutError, WeightsyncError  # noqa: E402
from weightsync.verl import VerlActorWorkerGroup, VerlRolloutReplica  # noqa: E402

from tests.adapters.verl.conftest import VerlWorld  # noqa: E402
from tests.adapters.verl.workloads import ToyReplica, mismatches, model_weights  # noqa: E402
from tests.liveness import measure_liveness  # noqa: E402

FQN = "weightsync.verl.CheckpointEngineManager"
PAUSE = ["abort_all_requests", "release_kv_cache"]
RESUME = ["resume_kv_cache", "resume_generation"]


def load_manager(world: VerlWorld, fqn: str = FQN) -> Any:
    # ray_trainer.py: load_class_from_fqn(checkpoint_manager_class_fqn, "CheckpointEngineManager")(config=...)
    manager_class = load_class_from_fqn(fqn, "CheckpointEngineManager")
    return manager_class(config=world.config, actor_wg=world.actor_wg, replicas=world.replicas)


def assert_bit_exact(world: VerlWorld, step: int) -> None:
    received = world.received()
    assert len(received) == 3
    for tensors, updates in received:
        assert mismatches(tensors, model_weights(step)) == []
        assert updates[-1]["global_steps"] == step  # verl's step reaches the server adapter as its label


def test_sync_positional_calls_like_the_ppo_trainer(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world)
    manager.sleep_replicas()  # RayPPOTrainer.init_workers, after building the manager
    verl_world.clear_hooks()
    for step in (0, 1, 1, 2):  # fit() starts at 0; validation repeats a step
        verl_world.set_model(step)
        metrics = manager.update_weights(step)  # synchronous, positional, no event loop running
        assert isinstance(metrics, dict) and all(isinstance(value, float) for value in metrics.values())
        assert metrics["weightsync/bytes"] == sum(t.numel() * t.element_size() for _, t in model_weights(step))
        assert_bit_exact(verl_world, step)
    assert metrics["weightsync/topology_rebuilt"] == 0.0  # same workers: the epoch is reused
    for replica in verl_world.replicas:
        assert replica.hooks == (PAUSE + RESUME) * 4


def test_awaited_calls_like_the_fully_async_trainer(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world)
    verl_world.clear_hooks()

    async def fully_async_trainer() -> dict[str, float]:
        verl_world.set_model(7)
        metrics: dict[str, float] = await manager.update_weights(global_steps=7)
        await manager.abort_replicas()
        await manager.abort_replicas(reject_request=True)
        await manager.resume_generation_replicas()
        await manager.sleep_replicas()
        await manager.wake_up_replicas()
        return metrics

    metrics = asyncio.run(fully_async_trainer())
    assert metrics["weightsync/receivers"] == 3.0
    assert_bit_exact(verl_world, 7)
    for replica in verl_world.replicas:
        assert replica.hooks == PAUSE + RESUME + [
            "abort_all_requests", "abort_all_requests(reject)", "resume_generation", "sleep", "wake_up"]


def test_membership_edits_of_the_replicas_list_are_picked_up(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world)
    manager.update_weights(10)
    manager.remove_replicas([verl_world.replicas[1]])
    verl_world.set_model(11)
    metrics = manager.update_weights(11)
    assert metrics["weightsync/receivers"] == 2.0 and metrics["weightsync/topology_rebuilt"] == 1.0
    manager.replicas.append(verl_world.replicas[1])  # what verl's fully-async trainer does to its manager
    metrics = manager.update_weights(11)
    assert metrics["weightsync/receivers"] == 3.0 and metrics["weightsync/topology_rebuilt"] == 1.0
    assert_bit_exact(verl_world, 11)


def test_the_manager_never_blocks_its_event_loop(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world)
    verl_world.set_model(20, delay=0.25)  # ten tensors x 0.25 s: an update of about 2.5 s
    try:
        async def ours() -> None:
            await manager.update_weights(global_steps=20)

        ticks, worst, seconds = asyncio.run(measure_liveness(ours))
        assert seconds >= 2.0
        assert ticks >= 100 and worst < 0.2, (ticks, worst)
        assert_bit_exact(verl_world, 20)

        # Negative control: verl's own manager, same world and workload, calls ray.get inside its coroutine.
        verl_manager = VerlManager(config=verl_world.config, actor_wg=verl_world.actor_wg,
                                   replicas=verl_world.replicas)

        async def verls() -> None:
            await verl_manager.update_weights(global_steps=21)

        ticks, worst, seconds = asyncio.run(measure_liveness(verls))
        assert seconds >= 2.0
        assert not (ticks >= 100 and worst < 0.2), (ticks, worst)
    finally:
        verl_world.set_model(20)


def _resumed(hooks: list[str]) -> bool:
    """Whether a replica's hook log ends with both resume hooks having run after its last pause."""
    last_pause = max((i for i, hook in enumerate(hooks) if hook in PAUSE), default=-1)
    return all(hook in hooks[last_pause + 1:] for hook in RESUME)


def test_the_resume_checker_can_fail() -> None:
    assert _resumed(PAUSE + RESUME)
    assert not _resumed(PAUSE)
    assert not _resumed(PAUSE + ["resume_kv_cache"])
    assert not _resumed(PAUSE + RESUME + PAUSE)


def test_a_receiver_failing_mid_update_is_typed_and_replicas_are_resumed(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world, "weightsync.verl.ResumingCheckpointEngineManager")
    manager.update_weights(30)
    verl_world.clear_hooks()
    verl_world.set_model(31)
    verl_world.fail_next_update(replica=0, worker=1, after=2)
    with pytest.raises(WeightsyncError) as failure:
        manager.update_weights(31)
    # The failed worker released the sender at once: the update failed on the peer's error, not on a deadline.
    assert not isinstance(failure.value, StepTimeoutError), failure.value
    assert all(_resumed(replica.hooks) for replica in verl_world.replicas), [r.hooks for r in verl_world.replicas]
    # The next update repairs everything.
    verl_world.set_model(32)
    metrics = manager.update_weights(32)
    assert metrics["weightsync/topology_rebuilt"] == 1.0
    assert_bit_exact(verl_world, 32)


def test_by_default_half_written_replicas_reject_requests_until_repaired(verl_world: VerlWorld) -> None:
    manager = load_manager(verl_world)
    manager.update_weights(40)
    verl_world.clear_hooks()
    verl_world.set_model(41)
    verl_world.fail_next_update(replica=1, worker=0, after=3)
    with pytest.raises(WeightsyncError) as failure:
        manager.update_weights(41)
    assert not isinstance(failure.value, StepTimeoutError), failure.value
    states = [status.state for status in manager._core.status()]
    assert "torn" in states
    for replica, state in zip(verl_world.replicas, states):
        assert "resume_kv_cache" in replica.hooks  # memory is always given back
        if state == "torn":
            # Serves nothing from a half-written model, and parks no request forever.
            assert replica.hooks[-1] == "abort_all_requests(reject)" and "resume_generation" not in replica.hooks
        else:
            assert _resumed(replica.hooks)
    verl_world.set_model(42)
    manager.update_weights(42)
    assert all(_resumed(replica.hooks) for replica in verl_world.replicas)
    assert_bit_exact(verl_world, 42)


def test_wrappers_name_what_is_missing() -> None:
    with pytest.raises(ConfigError, match="no bound execute_checkpoint_engine, update_weights"):
        VerlActorWorkerGroup(object())

    class Half:
        workers: list[Any] = []

        async def abort_all_requests(self) -> None: ...

    with pytest.raises(ConfigError, match="lacks release_kv_cache, resume_kv_cache, resume_generation, sleep"):
        VerlRolloutReplica(Half())
    with pytest.raises(ConfigError, match="lacks workers"):
        VerlRolloutReplica(object())
    assert VerlRolloutReplica(ToyReplica(0, [])).workers == []


def test_bad_configuration_raises_at_construction(verl_world: VerlWorld) -> None:
    from verl.workers.config import CheckpointEngineConfig

    manager_class = load_class_from_fqn(FQN, "CheckpointEngineManager")
    with pytest.raises(ConfigError, match="verl's own CheckpointEngineManager"):
        manager_class(config=CheckpointEngineConfig(backend="nccl"), actor_wg=verl_world.actor_wg, replicas=[])
    old_style: dict[str, Any] = {"trainer": verl_world.actor_wg}
    with pytest.raises(RenamedKeywordError, match="actor_wg="):
        manager_class(config=verl_world.config, replicas=[], **old_style)
    bad = CheckpointEngineConfig(backend="weightsync.shm", engine_kwargs={"weightsync.shm": {"slots": 0}})
    with pytest.raises(ConfigError, match="slots"):
        manager_class(config=bad, actor_wg=verl_world.actor_wg, replicas=[])
    staged = CheckpointEngineConfig(backend="weightsync.shm", engine_kwargs={"weightsync.shm": {"staged": True}})
    with pytest.raises(ConfigError, match="staged update needs rollout workers that stage it"):
        manager_class(config=staged, actor_wg=verl_world.actor_wg, replicas=[])
