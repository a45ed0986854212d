"""The shipped conformance suite over the real mooncake library: separate processes, one-sided reads along the chain.

Not skipped when the library fails to load: that is a failure of this backend in CI.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.backends.placements import MixedPlacement, OnEmulatedDevice
from tests.backends.twolevel import TwoLevelHosts
from weightsync.api.testing import EngineConformance


class TestMooncakeConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "mooncake"

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return 3  # a chain of three hops: the middle one forwards while it reads


class TestMooncakeTreeConformance(EngineConformance):
    """The same cases with fan-out 2 (a tree: the sender serves two readers) and a three-slot ring."""

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "mooncake"

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return 3

    @pytest.fixture(scope="class")
    @classmethod
    def engine_options(cls) -> dict[str, Any]:
        return {"fanout": 2, "slots": 3}


class TestMooncakeOnDevice(OnEmulatedDevice, TestMooncakeConformance):
    """Every case with sources and destinations on the emulated accelerator, through the host ring (a device ring
    needs CUDA: tools/gpu-check runs it)."""


class TestMooncakeMixedDevices(MixedPlacement, TestMooncakeOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""



class TestMooncakeTwoLevel(TwoLevelHosts, TestMooncakeConformance):
    pass
