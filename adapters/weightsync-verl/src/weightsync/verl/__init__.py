"""weightsync inside verl 0.9: backends in verl's registry, typed wrappers, a drop-in manager, an actor mixin.

Importing this module registers every installed weightsync backend in verl's ``CheckpointEngineRegistry`` as
``weightsync.<name>`` (idempotently: importing it again, or reloading it, changes nothing). That is what verl's
``checkpoint_engine.custom_backend_module=weightsync.verl`` does in the driver and in every worker process::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightsync.shm
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightsync.verl
    # optional: weightsync's manager instead of verl's (non-blocking, timed, resumes replicas on failure)
    actor_rollout_ref.rollout.checkpoint_manager_class=weightsync.verl.CheckpointEngineManager

- :class:`VerlCheckpointEngine` (``engine``): verl's ``CheckpointEngine`` contract over a weightsync engine.
- :class:`VerlActorWorkerGroup`, :class:`VerlRolloutReplica` (``groups``): weightsync's Protocols over verl's
  ``RayWorkerGroup`` and ``RolloutReplica``, checked at construction.
- :class:`CheckpointEngineManager` (``manager``): the drop-in for ``checkpoint_manager_class``.
- :class:`WeightsyncActorMixin` (``worker``): ``execute_checkpoint_engine`` / ``update_weights`` for actor workers.
- :func:`read_checkpoint_config` (``config``): the one reader of verl's checkpoint-engine config both sides use.
"""

from importlib.metadata import version as _version

from weightsync.verl.config import CheckpointConfig, read_checkpoint_config
from weightsync.verl.engine import (
    REGISTRY_PREFIX,
    VerlCheckpointEngine,
    engine_class_for,
    register_backends,
    sync_config_from_engine_kwargs,
)
from weightsync.verl.groups import VerlActorWorkerGroup, VerlRolloutReplica, VerlRolloutWorker
from weightsync.verl.manager import CheckpointEngineManager, ResumingCheckpointEngineManager, sync_or_awaitable
from weightsync.verl.worker import WeightsyncActorMixin

__version__ = _version("weightsync-verl")
"""This distribution's version (from its installed metadata)."""

REGISTERED: list[str] = register_backends()
"""verl registry names this process registered (``weightsync.shm``, ``weightsync.gloo``, ...)."""

__all__ = [
    "REGISTRY_PREFIX",
    "REGISTERED",
    "VerlCheckpointEngine",
    "engine_class_for",
    "register_backends",
    "sync_config_from_engine_kwargs",
    "VerlActorWorkerGroup",
    "VerlRolloutReplica",
    "VerlRolloutWorker",
    "CheckpointEngineManager",
    "ResumingCheckpointEngineManager",
    "sync_or_awaitable",
    "WeightsyncActorMixin",
    "CheckpointConfig",
    "read_checkpoint_config",
]
