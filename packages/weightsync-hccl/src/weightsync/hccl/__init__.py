"""Backend ``hccl`` (Ascend NPUs). The engine, and torch_npu with it, is imported lazily."""

from typing import Any

__all__ = ["HcclCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "HcclCheckpointEngine":
        from weightsync.hccl.engine import HcclCheckpointEngine

        return HcclCheckpointEngine
    raise AttributeError(name)
