from __future__ import annotations

import pytest

from weightsync.api.testing import EngineConformance


class TestShmConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "shm"
