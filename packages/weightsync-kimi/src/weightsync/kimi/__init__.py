"""Backend ``kimi`` over MoonshotAI's checkpoint-engine. The engine (and checkpoint_engine) is imported lazily."""

from typing import Any

__all__ = ["KimiCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name == "KimiCheckpointEngine":
        from weightsync.kimi.engine import KimiCheckpointEngine

        return KimiCheckpointEngine
    raise AttributeError(name)
