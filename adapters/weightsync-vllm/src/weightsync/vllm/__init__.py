"""weightsync inside vLLM: any weightsync backend as vLLM's weight-transfer engine, driven by weightsync's manager.

- Every vLLM process loads the ``vllm.general_plugins`` entry point :func:`weightsync.vllm.plugin.register`,
  which registers the engine ``"weightsync"``; start vLLM with ``weight_transfer_config={"backend": "weightsync"}``
  and ``worker_extension_cls="weightsync.vllm.extension.WeightsyncWorkerExtension"`` (``VllmRolloutReplica`` does).
- :class:`~weightsync.vllm.replica.VllmRolloutReplica` is one ``AsyncLLM`` engine in a Ray actor, a
  ``RolloutReplica`` for ``CheckpointEngineManager(actor_wg=..., replicas=...)``.

What arrives is loaded by vLLM's own checkpoint loader (layerwise reload); see ``weightsync.vllm.engine`` for how
weightsync's lifecycle maps onto vLLM's and what is done differently to keep a replica from serving wrong weights.
Importing this package does not import vLLM; its modules do.
"""

from __future__ import annotations

from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

__version__ = _version("weightsync-vllm")
"""This distribution's version (from its installed metadata)."""

if TYPE_CHECKING:
    from weightsync.vllm.replica import VllmEngineActor, VllmRolloutReplica, engine_args

__all__ = ["VllmEngineActor", "VllmRolloutReplica", "engine_args"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from weightsync.vllm import replica

        return getattr(replica, name)
    raise AttributeError(f"module 'weightsync.vllm' has no attribute {name!r}")
