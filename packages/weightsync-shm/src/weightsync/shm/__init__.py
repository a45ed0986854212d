"""Backend ``shm``: same-host POSIX shared memory. The engine is imported lazily (``ShmCheckpointEngine``)."""

from typing import Any

__all__ = ["ShmCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "ShmCheckpointEngine":
        from weightsync.shm.engine import ShmCheckpointEngine

        return ShmCheckpointEngine
    raise AttributeError(name)
