"""The shipped conformance suite over the tcp backend: separate processes, reads served over TCP along the chain."""

from __future__ import annotations

from typing import Any

import pytest

from tests.backends.placements import MixedPlacement, OnEmulatedDevice
from tests.backends.twolevel import TwoLevelHosts
from weightsync.api.testing import EngineConformance


class TestTcpConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "tcp"

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return 3  # a chain of three hops: the middle one forwards while it reads


class TestTcpTreeConformance(TestTcpConformance):
    """The same cases with fan-out 2 (a tree: the sender serves two readers) and a three-slot ring."""

    @pytest.fixture(scope="class")
    @classmethod
    def engine_options(cls) -> dict[str, Any]:
        return {"fanout": 2, "slots": 3}


class TestTcpOnDevice(OnEmulatedDevice, TestTcpConformance):
    """Every case with sources and destinations on the emulated accelerator, staged through the host ring."""


class TestTcpMixedDevices(MixedPlacement, TestTcpOnDevice):
    """Host and device tensors interleaved in one update, on both sides."""


class TestTcpTwoLevel(TwoLevelHosts, TestTcpConformance):
    pass
