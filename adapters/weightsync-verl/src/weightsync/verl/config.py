"""One reader of verl's checkpoint-engine config, for the manager (on the driver) and the actor mixin (in workers).

Both sides must derive the same engine from the same config — the manager's ``prepare(engine=spec)`` reuses what
the workers built only when the specs are equal — so they read it here, the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightsync.api.errors import ConfigError

__all__ = ["DEFAULT_BACKEND", "CheckpointConfig", "config_value", "read_checkpoint_config"]

DEFAULT_BUCKET_MEGABYTES = 2048
"""verl's default ``update_weights_bucket_megabytes``."""


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """Read verl's ``CheckpointEngineConfig`` (a dataclass), an OmegaConf ``DictConfig`` or a plain mapping."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


DEFAULT_BACKEND = "weightsync.auto"
"""What an unnamed ``checkpoint_engine.backend`` means: weightsync's manager picks shm on one host, the two-level
chain over the fastest network library across hosts."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What weightsync takes from verl's checkpoint-engine config."""

    backend: str
    """verl's registry name of the backend (``weightsync.shm`` for ours)."""
    modules: tuple[str, ...]
    """``custom_backend_module``: modules to import (in the driver and every worker) before building engines."""
    bucket_bytes: int
    """``update_weights_bucket_megabytes``, in bytes."""
    engine_kwargs: dict[str, Any]
    """``engine_kwargs[backend]``: the backend's constructor keywords."""

    def import_modules(self) -> None:
        """Import ``custom_backend_module`` (where ``weightsync.verl`` or a user's plugin registers backends)."""
        for module in self.modules:
            importlib.import_module(module)


def read_checkpoint_config(config: Any) -> CheckpointConfig:
    """Read and check verl's ``checkpoint_engine`` config; a bad value is a ``ConfigError`` naming the key."""
    backend = config_value(config, "backend")
    if backend is None or backend == "":
        backend = DEFAULT_BACKEND
    if not isinstance(backend, str):
        raise ConfigError(f"checkpoint_engine.backend must name a backend, got {backend!r}")
    megabytes = config_value(config, "update_weights_bucket_megabytes", DEFAULT_BUCKET_MEGABYTES)
    if isinstance(megabytes, bool) or not isinstance(megabytes, int) or megabytes < 1:
        raise ConfigError(f"update_weights_bucket_megabytes must be a positive int, got {megabytes!r}")
    all_kwargs = config_value(config, "engine_kwargs") or {}
    engine_kwargs = all_kwargs.get(backend, {}) if isinstance(all_kwargs, Mapping) else {}
    return CheckpointConfig(
        backend=backend, modules=_modules(config_value(config, "custom_backend_module")), bucket_bytes=megabytes << 20,
        engine_kwargs=dict(engine_kwargs or {}),
    )


def _modules(value: Any) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(item) for item in value)
