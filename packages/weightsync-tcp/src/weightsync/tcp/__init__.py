"""Backend ``tcp``: the pipelined chain over plain TCP sockets, each upstream serving reads of its ring. The engine
is imported lazily (``TcpCheckpointEngine``)."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-tcp")
"""This distribution's version (from its installed metadata)."""

__all__ = ["TcpCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "TcpCheckpointEngine":
        from weightsync.tcp.engine import TcpCheckpointEngine

        return TcpCheckpointEngine
    raise AttributeError(name)
