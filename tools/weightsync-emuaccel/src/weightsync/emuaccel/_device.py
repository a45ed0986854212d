"""The runtime module that ``install()`` registers as ``torch.emu`` (``torch.get_device_module("emu")``).

torch looks here for the per-backend functions that ``torch.cuda`` provides for CUDA: ``is_available``,
``device_count``, ``current_device``, ``set_device``, ``synchronize`` (device-wide, and counted), and what
``torch.manual_seed`` and autocast ask of a custom backend. Streams and events are torch's generic ones
(``torch.Stream(device="emu")``, ``torch.Event(device="emu")``, ``torch.accelerator.*``); the helpers below only
forward to them, for code written against the ``torch.cuda`` spelling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

DEVICE_TYPE = "emu"

DeviceLike = int | str | torch.device | None


def _index(device: DeviceLike) -> int:
    """A device index; None (or "emu" without an index) means the current device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    resolved = torch.device(device)
    if resolved.type != DEVICE_TYPE:
        raise ValueError(f"expected an {DEVICE_TYPE} device, got {resolved}")
    return current_device() if resolved.index is None else resolved.index


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    """Nothing to do: the library initialises itself when it is loaded."""


def _is_in_bad_fork() -> bool:
    """True in a process forked after its parent used the device (the device refuses to run there, as CUDA)."""
    return bool(torch.ops.weightsync_emu.in_bad_fork())


def device_count() -> int:
    return int(torch.ops.weightsync_emu.device_count())


def current_device() -> int:
    return int(torch.ops.weightsync_emu.current_device())


def set_device(device: DeviceLike) -> None:
    torch.ops.weightsync_emu.set_device(_index(device))


@contextlib.contextmanager
def device(which: DeviceLike) -> Iterator[None]:
    """Make ``which`` the current emu device for the block (as ``torch.cuda.device``; torch's storage ``.to`` uses
    it when it loads a checkpoint onto the device)."""
    previous = current_device()
    set_device(which)
    try:
        yield
    finally:
        set_device(previous)


def synchronize(device: DeviceLike = None) -> None:
    """Wait for every stream of the device: a device-wide synchronization (counted by ``synchronizations()``)."""
    torch.ops.weightsync_emu.synchronize(_index(device))


def current_stream(device: DeviceLike = None) -> torch.Stream:
    return torch.accelerator.current_stream(_index(device))


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: torch.Stream) -> Iterator[torch.Stream]:
    """Make ``stream`` the current stream of its device for the block (as ``torch.cuda.stream``)."""
    with stream:
        yield stream


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes held by live tensors on the device (page-rounded per allocation)."""
    return int(torch.ops.weightsync_emu.memory_allocated(_index(device)))


def empty_cache() -> None:
    """Unmap the cached free blocks that no stream can still use."""
    torch.ops.weightsync_emu.empty_cache()


def manual_seed(seed: int) -> None:
    """Random numbers on emu tensors come from the CPU generator (the CPU fallback runs the kernel), which
    ``torch.manual_seed`` already seeds; there is no device generator to seed."""


def manual_seed_all(seed: int) -> None:
    """See ``manual_seed``."""


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]
