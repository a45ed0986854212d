"""Backend ``shm``: same-host POSIX shared memory. The engine is imported lazily (``ShmCheckpointEngine``)."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-shm")
"""This distribution's version (from its installed metadata)."""

__all__ = ["ShmCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "ShmCheckpointEngine":
        from weightsync.shm.engine import ShmCheckpointEngine

        return ShmCheckpointEngine
    raise AttributeError(name)
