"""Backend ``gloo``. The engine is imported lazily."""

from importlib.metadata import version as _version
from typing import Any

__version__ = _version("weightsync-gloo")
"""This distribution's version (from its installed metadata)."""

__all__ = ["GlooCheckpointEngine", "GlooTransport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.gloo import collective

        return getattr(collective, name)
    raise AttributeError(name)
