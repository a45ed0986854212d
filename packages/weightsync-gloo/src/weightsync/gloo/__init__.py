"""Backend ``gloo``. The engine is imported lazily."""

from typing import Any

__all__ = ["GlooCheckpointEngine", "GlooTransport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.gloo import collective

        return getattr(collective, name)
    raise AttributeError(name)
