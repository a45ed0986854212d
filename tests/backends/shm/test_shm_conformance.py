from __future__ import annotations

import pytest

from tests.devices import EMULATED
from weightsync.api.testing import EngineConformance


class TestShmConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "shm"


class TestShmOnDevice(TestShmConformance):
    """Every case with sources and destinations on the emulated accelerator: staged through pinned host buckets."""

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls) -> str:
        return EMULATED


class TestShmMixedDevices(TestShmOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""

    @pytest.fixture(scope="class")
    @classmethod
    def placement(cls) -> str:
        return "mixed"
