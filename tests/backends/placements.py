"""Mixins that move a backend's conformance class onto the emulated accelerator: put one before the class it
extends (``class TestXOnDevice(OnEmulatedDevice, TestXConformance)``) so that its fixture wins."""

from __future__ import annotations

import pytest

from tests.devices import EMULATED


class OnEmulatedDevice:
    """Every case with sources and destinations on the emulated accelerator."""

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls) -> str:
        return EMULATED


class MixedPlacement:
    """Host and device tensors interleaved in one update, on both sides."""

    @pytest.fixture(scope="class")
    @classmethod
    def placement(cls) -> str:
        return "mixed"
