"""Backend ``gloo`` and the collective engine it instantiates. Engines are imported lazily."""

from typing import Any

__all__ = ["GlooCheckpointEngine", "CollectiveCheckpointEngine"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.gloo import collective

        return getattr(collective, name)
    raise AttributeError(name)
