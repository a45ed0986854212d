"""Backend ``nccl`` and the accelerator layer it shares with ``hccl``. The engine is imported lazily."""

from typing import Any

__all__ = ["NcclCheckpointEngine", "AcceleratorCollectiveEngine"]


def __getattr__(name: str) -> Any:
    if name == "NcclCheckpointEngine":
        from weightsync.nccl.engine import NcclCheckpointEngine

        return NcclCheckpointEngine
    if name == "AcceleratorCollectiveEngine":
        from weightsync.nccl.device import AcceleratorCollectiveEngine

        return AcceleratorCollectiveEngine
    raise AttributeError(name)
