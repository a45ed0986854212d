"""Backend ``nccl``. The engine is imported lazily."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-nccl")
"""This distribution's version (from its installed metadata)."""

__all__ = ["NcclCheckpointEngine", "NcclTransport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.nccl import engine

        return getattr(engine, name)
    raise AttributeError(name)
