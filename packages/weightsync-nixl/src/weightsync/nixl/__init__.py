"""Backend ``nixl``: NIXL (UCX) one-sided reads along a pipelined chain. The engine is imported lazily
(``NixlCheckpointEngine``)."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-nixl")
"""This distribution's version (from its installed metadata)."""

__all__ = ["NixlCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "NixlCheckpointEngine":
        from weightsync.nixl.engine import NixlCheckpointEngine

        return NixlCheckpointEngine
    raise AttributeError(name)
