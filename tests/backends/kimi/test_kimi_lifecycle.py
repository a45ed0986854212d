"""The kimi lifecycle against the fake ParameterServer world (``fake_world``), the refusals, and the real thing
on GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util

import pytest
import torch

from tests.backends.kimi.fake_world import EXPECTED, kimi_engines, run_update, run_updates
from weightsync.api.errors import (
    BackendUnavailableError,
    ConcurrentUpdateError,
    DigestMismatchError,
    LifecycleError,
    TopologyError,
)
from weightsync.api.testing import case_tensors
from weightsync.api.types import TransferReport
from weightsync.kimi.engine import KimiCheckpointEngine


def test_broadcast_update_through_the_fake_parameter_server() -> None:
    world, senders, receivers = run_updates(2, 2, updates=2)
    names = {name for name, _ in case_tensors("mixed", 2, 1 << 16)}
    shares = [set(next(args["names"] for rank, method, args in world.calls
                       if rank == actor and method == "register_checkpoint")) for actor in range(2)]
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == names
    assert not [call for call in world.calls if call[1] == "register_checkpoint" and call[0] >= 2]
    inits = [args for _, method, args in world.calls if method == "__init__"]
    assert all(args["auto_pg"] is False and args["world_size"] == 4 for args in inits)
    assert sorted(args["rank"] for args in inits) == [0, 1, 2, 3]
    updates = [(rank, args["ranks"]) for rank, method, args in world.calls if method == "update"]
    assert sorted(updates) == [(rank, None) for rank in range(4) for _ in range(2)]  # two updates, every PS rank
    assert all(isinstance(report, TransferReport) for report in senders), senders
    digests = {report.digest for report in senders}
    assert len(digests) == 1  # every actor rank reports the whole update's digest
    for report, same in receivers:
        assert report is not None and report.digest in digests and report.version == 2 and report.sender == 0
        assert set(same) == names and all(same.values())  # views were read before the buffer was reused
    unregistered = [(rank, args["force"]) for rank, method, args in world.calls if method == "unregister_checkpoint"]
    # Each update's finalize keeps the shared pool; close frees it, once, on the ranks that registered.
    assert sorted(unregistered) == [(0, False), (0, False), (0, True), (1, False), (1, False), (1, True)]
    assert [method for _, method, _ in world.calls].count("destroy_process_group") == 4


def test_p2p_update_names_the_rollout_ranks() -> None:
    world, senders, receivers = run_updates(1, 2, mode="p2p")
    updates = sorted((rank, args["ranks"]) for rank, method, args in world.calls if method == "update")
    assert updates == [(0, [1, 2]), (1, [1, 2]), (2, [1, 2])]
    assert all(report is not None for report, _ in receivers), receivers


def test_corruption_in_transit_is_a_digest_mismatch() -> None:
    _, senders, receivers = run_updates(1, 1, corrupt=True)
    assert isinstance(receivers[0], DigestMismatchError), receivers


@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="checkpoint-engine's ParameterServer needs a CUDA GPU "
                    "per worker: two GPUs at least")
def test_kimi_on_gpus() -> None:
    from weightsync.api.testing import EngineHarness

    harness = EngineHarness("kimi", receivers=1, bucket_bytes=1 << 20)
    harness.start()
    try:
        harness.setup()
        harness.update("mixed", 1)
    finally:
        harness.close()


def test_steps_out_of_order_are_lifecycle_errors() -> None:
    _, engines = kimi_engines(1, 1)
    actor, rollout = engines
    try:
        assert actor.epoch is not None and actor.epoch == rollout.epoch and rollout.role == "receiver"
        with pytest.raises(LifecycleError, match="role"):
            actor.receive_weights()
        with pytest.raises(LifecycleError, match="role"):
            asyncio.run(rollout.send_weights([], version=1))
    finally:
        for engine in engines:
            engine.close()
    left: KimiCheckpointEngine = actor  # (a fresh name: mypy still holds the epoch asserted above)
    assert left.epoch is None and left.role is None  # close left the epoch
    with pytest.raises(LifecycleError, match="closed"):
        actor.prepare()
    fresh = KimiCheckpointEngine(bucket_bytes=1 << 16)
    with pytest.raises(LifecycleError, match="before init_process_group"):
        asyncio.run(fresh.send_weights([], version=1))
    with pytest.raises(TopologyError, match="malformed rank_args"):
        fresh.init_process_group(rank_args={"role": "sender"})
    fresh.close()


def test_one_update_at_a_time() -> None:
    _, engines = kimi_engines(1, 1)
    actor, rollout = engines
    try:
        stream = rollout.receive_weights()
        with pytest.raises(ConcurrentUpdateError, match="receive_weights"):
            rollout.receive_weights()
        with pytest.raises(ConcurrentUpdateError, match="init_process_group"):
            rollout.init_process_group(rank_args={})
        asyncio.run(stream.aclose())
        asyncio.run(rollout.receive_weights().aclose())  # free again once the stream is left

        async def two_sends() -> None:
            weights = [(f"w{index}", torch.zeros(1)) for index in range(256)]
            first = asyncio.create_task(actor.send_weights(weights, version=1))
            await asyncio.sleep(0)  # the first drains its stream up to its first pause
            with pytest.raises(ConcurrentUpdateError, match="send_weights"):
                await actor.send_weights([], version=2)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
            again = asyncio.create_task(actor.send_weights(weights, version=3))
            await asyncio.sleep(0)
            assert not again.done()  # the cancelled send let go of the engine
            again.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await again

        asyncio.run(two_sends())
    finally:
        for engine in engines:
            engine.close()


def test_a_consumer_that_leaves_early_does_not_stall_the_update() -> None:
    _, engines = kimi_engines(1, 2)
    try:
        left = run_update(engines, leave_after=2)
        after = run_update(engines)  # each receiver takes the engine over once its drained update is done
    finally:
        for engine in engines:
            engine.close()
    assert isinstance(left[0], TransferReport), left
    for report, same in left[1:]:
        assert report is None and len(same) == 2 and all(same.values())
    assert isinstance(after[0], TransferReport), after
    for report, same in after[1:]:
        assert report is not None and report.digest == after[0].digest and set(same) == set(EXPECTED)


def test_p2p_without_mooncake_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "mooncake" else find_spec(name, *args))
    engine = KimiCheckpointEngine(bucket_bytes=1 << 16, mode="p2p")
    args = {"role": "sender", "ps_rank": 0, "ps_world_size": 2, "master_addr": "127.0.0.1", "master_port": 1,
            "actor_wg_world_size": 1, "epoch": "e"}
    with pytest.raises(BackendUnavailableError, match=r"weightsync-kimi\[p2p\]"):
        engine.init_process_group(rank_args=args)  # type: ignore[arg-type]
    engine.close()
