"""The ``vllm.general_plugins`` entry point: registers ``"weightsync"`` in vLLM's ``WeightTransferEngineFactory``.

vLLM calls it in every one of its processes, possibly more than once, and the factory raises ``ValueError`` on a
name registered twice: a name already there is left as it is (``weightsync.vllm.internals.register_engine``). The
class is registered by module path, so a process that never builds the engine never imports weightsync's engine
module.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from weightsync.vllm.engine import BACKEND
    from weightsync.vllm.internals import register_engine

    register_engine(BACKEND, "weightsync.vllm.engine", "WeightsyncTransferEngine")
