"""Backend ``mooncake``: Mooncake TransferEngine, one-sided reads along a pipelined chain.

The engine is imported lazily (``MooncakeCheckpointEngine``); :mod:`weightsync.core.transports.chain.transport` holds
the chain transport and topology that the ``nixl`` backend shares.
"""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-mooncake")
"""This distribution's version (from its installed metadata)."""

__all__ = ["MooncakeCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeCheckpointEngine":
        from weightsync.mooncake.engine import MooncakeCheckpointEngine

        return MooncakeCheckpointEngine
    raise AttributeError(name)
