from __future__ import annotations

import pytest

from tests.backends.placements import MixedPlacement, OnEmulatedDevice
from weightsync.api.testing import EngineConformance


class TestShmConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "shm"


class TestShmOnDevice(OnEmulatedDevice, TestShmConformance):
    """Every case with sources and destinations on the emulated accelerator: staged through pinned host buckets."""


class TestShmMixedDevices(MixedPlacement, TestShmOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""
