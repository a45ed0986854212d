"""Backend ``hccl`` (Ascend NPUs). The engine, and torch_npu with it, is imported lazily."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-hccl")
"""This distribution's version (from its installed metadata)."""

__all__ = ["HcclCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "HcclCheckpointEngine":
        from weightsync.hccl.engine import HcclCheckpointEngine

        return HcclCheckpointEngine
    raise AttributeError(name)
