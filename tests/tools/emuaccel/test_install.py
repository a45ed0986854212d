"""install() in this process and in others: the device type, torch.accelerator, torch.emu, spawned and Ray workers."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
import torch

from tests.conftest import RayNodes
from tests.tools.emuaccel.processes import run_python
from weightsync.emuaccel import DEVICE_TYPE, install, set_copy_delay


def test_install_returns_the_device_type_and_is_idempotent(emu: str) -> None:
    assert install() == install() == emu == DEVICE_TYPE == "emu"
    assert torch.device(install()).type == install()
    assert torch.device(install()).index is None


def test_the_current_accelerator_is_emu(emu: str) -> None:
    assert torch.accelerator.current_accelerator() == torch.device("emu")
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 1
    assert torch.accelerator.current_device_index() == 0
    tensor = torch.ones(3).to(emu)
    assert tensor.device == torch.device("emu", 0) and tensor.is_emu  # type: ignore[attr-defined]


def test_torch_emu_is_the_device_module(emu: str) -> None:
    module: Any = torch.get_device_module(emu)
    assert module is torch.emu  # type: ignore[attr-defined]
    assert module.is_available() and module.device_count() == 1 and module.current_device() == 0
    module.set_device(0)
    module.set_device("emu:0")
    with pytest.raises(RuntimeError, match="invalid device index"):
        module.set_device(1)
    assert module.current_stream() == torch.accelerator.current_stream()
    before = module.memory_allocated()
    held = torch.empty(1 << 20, dtype=torch.uint8, device=emu)
    assert module.memory_allocated() == before + (1 << 20)
    del held


def test_accelerator_streams_through_the_device_guard(emu: str) -> None:
    default = torch.accelerator.current_stream()
    assert default.device == torch.device("emu", 0) and default.stream_id == 0
    side = torch.Stream(device=emu)
    assert side.stream_id != default.stream_id
    torch.accelerator.set_stream(side)
    try:
        assert torch.accelerator.current_stream() == side
    finally:
        torch.accelerator.set_stream(default)
    with side:
        assert torch.accelerator.current_stream() == side
    assert torch.accelerator.current_stream() == default
    torch.accelerator.synchronize()


def _round_trip_in_worker(values: list[float]) -> tuple[str, str, list[float]]:
    device = install()
    tensor = torch.tensor(values).to(device)
    return device, str(torch.accelerator.current_accelerator()), tensor.cpu().tolist()


def test_install_in_a_spawned_process() -> None:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        device, accelerator, values = pool.submit(_round_trip_in_worker, [1.5, -2.0, 3.25]).result(timeout=300)
    assert (device, accelerator, values) == ("emu", "emu", [1.5, -2.0, 3.25])


def test_install_in_a_ray_actor(ray_nodes: RayNodes) -> None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    worker: Any = ray.remote(num_cpus=0)(_RoundTripActor)
    actor = worker.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=ray_nodes.head, soft=False)).remote()
    try:
        device, accelerator, values = ray.get(actor.round_trip.remote([4.0, 5.5]), timeout=300)
    finally:
        ray.kill(actor)
    assert (device, accelerator, values) == ("emu", "emu", [4.0, 5.5])


class _RoundTripActor:
    def round_trip(self, values: list[float]) -> tuple[str, str, list[float]]:
        return _round_trip_in_worker(values)


def test_a_forked_child_refuses_the_device_its_parent_used(emu: str) -> None:
    torch.ones(4).to(emu).cpu()  # the parent's stream worker is running
    context = multiprocessing.get_context("fork")
    queue: Any = context.Queue()
    child = context.Process(target=_use_device_after_fork, args=(queue,))
    child.start()
    child.join(60)
    assert "use the 'spawn' start method" in queue.get(timeout=10)


def _use_device_after_fork(queue: Any) -> None:
    try:
        torch.ones(4).to("emu")
        queue.put("the child used the device")
    except RuntimeError as error:
        queue.put(str(error))


def test_the_copy_delay_comes_from_the_environment_at_install() -> None:
    result = run_python("""
        import time, torch
        from weightsync.emuaccel import install
        device = install()
        print(torch.ops.weightsync_emu.copy_delay())
        start = time.monotonic()
        torch.ones(4).to(device)  # a copy from pageable memory returns once it has run
        print(time.monotonic() - start)
    """, env={"WEIGHTSYNC_EMU_COPY_DELAY_MS": "250"})
    assert result.returncode == 0, result.stderr
    delay, elapsed = map(float, result.stdout.split())
    assert delay == 0.25 and elapsed >= 0.25


def test_a_malformed_copy_delay_is_an_error_naming_the_variable() -> None:
    result = run_python("""
        from weightsync.emuaccel import EmuError, install
        try:
            install()
        except EmuError as error:
            print(error)
    """, env={"WEIGHTSYNC_EMU_COPY_DELAY_MS": "soon"})
    assert result.returncode == 0, result.stderr
    assert "WEIGHTSYNC_EMU_COPY_DELAY_MS" in result.stdout


def test_set_copy_delay_rejects_negative_and_infinite_seconds(emu: str) -> None:
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="copy delay"):
            set_copy_delay(bad)
    set_copy_delay(0.05)
    start = time.monotonic()
    torch.ones(2).to(emu)
    assert time.monotonic() - start >= 0.05


def test_install_refuses_a_process_whose_privateuse1_backend_is_taken() -> None:
    result = run_python("""
        import torch
        torch.utils.rename_privateuse1_backend("other")
        from weightsync.emuaccel import EmuError, install
        try:
            install()
        except EmuError as error:
            print(error)
    """)
    assert result.returncode == 0, result.stderr
    assert "already 'other'" in result.stdout
