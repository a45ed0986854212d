from __future__ import annotations

import pytest

from tests.devices import EMULATED
from weightsync.api.testing import EngineConformance


class TestGlooConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "gloo"


class TestGlooOnDevice(TestGlooConformance):
    """Every case with sources and destinations on the emulated accelerator: staged through pinned host buckets."""

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls) -> str:
        return EMULATED


class TestGlooMixedDevices(TestGlooOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""

    @pytest.fixture(scope="class")
    @classmethod
    def placement(cls) -> str:
        return "mixed"
