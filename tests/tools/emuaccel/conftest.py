"""Fixtures for the emulated accelerator's tests: the device installed in this process, no copy delay left over."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from weightsync.emuaccel import install, set_copy_delay


@pytest.fixture
def emu() -> Iterator[str]:
    """The emu device type, installed here; a test's copy delay and queued work do not outlive it."""
    device = install()
    set_copy_delay(0.0)
    try:
        yield device
    finally:
        set_copy_delay(0.0)
        torch.accelerator.synchronize()

