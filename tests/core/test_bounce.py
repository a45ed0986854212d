"""The host bounce between accelerator tensors and host transports (and the upload the other way), on the emulated
accelerator, checked from outside.

Sender and receiver run in threads of this process (gloo's host buffers, shm's shared memory, and the accelerator
collective engine's device rings), with a delay in
every emulated device copy: a wait the pipeline leaves out then shows as wrong bytes. The negative controls take a
wait out on purpose and show that the byte comparison catches it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.backends.nccl.accel_gloo import SPEC as ACCELERATOR_ON_GLOO
from tests.devices import emulated_device, slow_copies
from weightsync.api.errors import ConfigError
from weightsync.api.registry import load_engine_class, register_backend
from weightsync.api.testing import case_tensors, place, raw_bytes
from weightsync.api.types import WorkerContext, WorldMetadata
from weightsync.core.pipeline import bounce
from weightsync.emuaccel import synchronizations

BUCKET = 1 << 16
Weights = list[tuple[str, torch.Tensor]]


def _update(backend: str, weights: Weights, destinations: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """One update from a sender to one receiver loading into ``destinations``; (sender report, receiver result)."""
    engine_class: Any = load_engine_class(backend)
    sender = engine_class(bucket_bytes=BUCKET, timeout=60,
                          context=WorkerContext(role="actor", rank=0, node_id="here"))
    receiver = engine_class(bucket_bytes=BUCKET, timeout=60,
                            context=WorkerContext(role="rollout", rank=0, node_id="here"))
    try:
        metadata = WorldMetadata(actor=[sender.prepare()], rollout=[receiver.prepare()])
        topology = engine_class.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata)
        _in_threads([lambda: sender.init_process_group(rank_args=topology.actor[0]),
                     lambda: receiver.init_process_group(rank_args=topology.rollout[0])])

        async def receive() -> int:
            stream = receiver.receive_weights()
            return int(await stream.copy_into(destinations))

        report, count = _in_threads([lambda: asyncio.run(sender.send_weights(weights, version=1)),
                                     lambda: asyncio.run(receive())])
        return report, count
    finally:
        sender.close()
        receiver.close()


def _in_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:  # re-raised below, in the test's thread
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _mismatches(weights: Weights, destinations: dict[str, torch.Tensor]) -> list[str]:
    return [name for name, tensor in weights if not torch.equal(raw_bytes(destinations[name]), raw_bytes(tensor))]


@pytest.fixture(scope="module")
def device() -> str:
    register_backend(ACCELERATOR_ON_GLOO)  # the accelerator collective engine, in this process
    return emulated_device()


@pytest.mark.parametrize("backend", ["gloo", "shm", ACCELERATOR_ON_GLOO.name])
def test_device_sources_reach_device_destinations_without_a_device_wide_sync(backend: str, device: str) -> None:
    weights = place(case_tensors("mixed", 1, BUCKET) + case_tensors("non_contiguous", 1, BUCKET), device, "device")
    destinations = {name: torch.zeros(tensor.shape, dtype=tensor.dtype, device=device) for name, tensor in weights}
    before = synchronizations()
    report, count = _update(backend, weights, destinations)
    assert synchronizations() == before  # counted by the emulator, not by weightsync
    assert count == len(weights) and report.buckets >= 3
    assert _mismatches(weights, destinations) == []


def test_a_missing_bounce_wait_is_caught_by_the_bytes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: packing before the device-to-host copies have run sends the pinned host bucket's old bytes."""
    monkeypatch.setattr(bounce, "wait_event", lambda *args, **kwargs: None)
    weights = place(case_tensors("mixed", 2, BUCKET), device, "device")
    destinations = {name: torch.zeros(tensor.shape, dtype=tensor.dtype) for name, tensor in weights}
    with slow_copies():
        _update("gloo", weights, destinations)
    assert _mismatches(weights, destinations)  # the sender hashed what it sent: only the bytes can tell


def test_the_planner_never_lists_a_device_address_for_a_host_copy(device: str) -> None:
    """Small pieces are batched by host address; an accelerator tensor's address must never be among them."""
    from weightsync.core.pipeline.planner import plan_buckets

    weights = place(case_tensors("many_small", 1, BUCKET), device, "mixed")
    device_addresses = {tensor.data_ptr() for _, tensor in weights if tensor.device.type == device}
    buckets = list(plan_buckets(weights, bucket_bytes=BUCKET, devices=frozenset({"cpu", device})))
    assert buckets and all(bucket.on_device for bucket in buckets)
    listed = {address for bucket in buckets for address in bucket.copies[1::3]}
    assert listed and not listed & device_addresses
    host_only = list(plan_buckets(case_tensors("many_small", 1, BUCKET), bucket_bytes=BUCKET,
                                  devices=frozenset({"cpu", device})))
    assert not any(bucket.on_device for bucket in host_only)


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_device_ring_without_cuda_is_a_typed_error_naming_the_way_out(backend: str, device: str) -> None:
    """Here the process's accelerator is the emulated one: a CUDA ring cannot be, and the host ring stages instead."""
    engine_class: Any = load_engine_class(backend)
    with pytest.raises(ConfigError, match="no CUDA device.*leave device='cpu'"):
        engine_class(bucket_bytes=BUCKET, device="cuda")
