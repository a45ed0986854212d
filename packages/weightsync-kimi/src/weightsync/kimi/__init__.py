"""Backend ``kimi`` over MoonshotAI's checkpoint-engine. The engine (and checkpoint_engine) is imported lazily."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-kimi")
"""This distribution's version (from its installed metadata)."""

__all__ = ["KimiCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "KimiCheckpointEngine":
        from weightsync.kimi.engine import KimiCheckpointEngine

        return KimiCheckpointEngine
    raise AttributeError(name)
