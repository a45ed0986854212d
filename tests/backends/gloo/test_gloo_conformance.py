from __future__ import annotations

import pytest

from tests.backends.placements import MixedPlacement, OnEmulatedDevice
from weightsync.api.testing import EngineConformance


class TestGlooConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "gloo"


class TestGlooOnDevice(OnEmulatedDevice, TestGlooConformance):
    """Every case with sources and destinations on the emulated accelerator: staged through pinned host buckets."""


class TestGlooMixedDevices(MixedPlacement, TestGlooOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""
