"""Backend ``mooncake``: Mooncake TransferEngine, one-sided reads along a pipelined chain.

The engine is imported lazily (``MooncakeCheckpointEngine``); :mod:`weightsync.core.transports.chain.transport` holds
the chain transport and topology that the ``nixl`` backend shares.
"""

from typing import Any

__all__ = ["MooncakeCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "MooncakeCheckpointEngine":
        from weightsync.mooncake.engine import MooncakeCheckpointEngine

        return MooncakeCheckpointEngine
    raise AttributeError(name)
