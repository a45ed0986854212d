"""Backend ``nccl``. The engine is imported lazily."""

from typing import Any

__all__ = ["NcclCheckpointEngine", "NcclTransport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.nccl import engine

        return getattr(engine, name)
    raise AttributeError(name)
