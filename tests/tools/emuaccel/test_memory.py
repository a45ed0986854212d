"""Device memory is not host memory: the host cannot read it, numpy cannot see it; pinned memory is told apart."""

from __future__ import annotations

import signal

import numpy
import pytest
import torch

from tests.tools.emuaccel.processes import run_python

READ_THROUGH_DATA_PTR = """
    import ctypes, torch
    from weightsync.emuaccel import install
    device = install()
    tensor = torch.arange(16, dtype=torch.uint8).to({where})
    torch.accelerator.synchronize()
    print(ctypes.string_at(tensor.data_ptr(), 16).hex(), flush=True)
"""


def test_a_host_read_through_a_device_data_ptr_faults() -> None:
    result = run_python(READ_THROUGH_DATA_PTR.replace("{where}", "device"), timeout=120)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""


def test_negative_control_the_same_read_of_a_cpu_tensor_works() -> None:
    result = run_python(READ_THROUGH_DATA_PTR.replace("{where}", "'cpu'"), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == bytes(range(16)).hex()


def test_numpy_and_memoryview_refuse_device_tensors(emu: str) -> None:
    host = torch.arange(8, dtype=torch.int32)
    assert host.numpy().data.tobytes() == bytes(host.untyped_storage())  # the control: a memoryview of host memory
    device = host.to(emu)
    with pytest.raises(TypeError, match="numpy"):
        device.numpy()
    with pytest.raises(TypeError):
        numpy.asarray(device)
    with pytest.raises(TypeError):
        memoryview(device)  # type: ignore[arg-type]


def test_pinned_memory_is_pinned_for_emu_and_ordinary_memory_is_not(emu: str) -> None:
    pinned = torch.empty(1024, pin_memory=True)
    assert pinned.is_pinned() and pinned.device.type == "cpu"
    assert torch.arange(10).pin_memory().is_pinned()
    assert not torch.empty(1024).is_pinned()
    assert not torch.empty(1024).clone().is_pinned()
    # A non_blocking copy to the host lands in pinned memory, as from CUDA.
    assert torch.ones(4).to(emu).to("cpu", non_blocking=True).is_pinned()


def test_device_pointers_are_not_host_pointers(emu: str) -> None:
    device = torch.zeros(4096, dtype=torch.uint8, device=emu)
    assert device.untyped_storage().data_ptr() != 0
    assert not device.is_pinned()
    # The storage's bytes reach the host only through a copy.
    assert bytes(device.untyped_storage()) == bytes(4096)


def test_running_out_of_device_memory_raises_torchs_out_of_memory_error() -> None:
    result = run_python("""
        import torch
        from weightsync.emuaccel import install
        device = install()
        kept = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        try:
            torch.empty(2 << 20, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError as error:
            print("out of memory:", "WEIGHTSYNC_EMU_MEMORY_BYTES" in str(error))
    """, env={"WEIGHTSYNC_EMU_MEMORY_BYTES": str(2 << 20)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "out of memory: True"
