"""``WeightsyncWorkerExtension``: the worker methods weightsync calls by name through vLLM's ``collective_rpc``.

vLLM mixes the class named by ``worker_extension_cls`` into its worker class, so these run in each worker process,
next to the model and the ``WeightsyncTransferEngine`` vLLM built there. They carry what vLLM's weight-transfer API
has no step for: ``prepare`` (which returns data) and reading back the outcome of the last update as plain data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightsync.api.errors import ConfigError
from weightsync.api.types import WorkerMetadata

__all__ = ["WeightsyncWorkerExtension"]


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def _weightsync(self) -> Any:
        from weightsync.vllm.engine import WeightsyncTransferEngine

        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, WeightsyncTransferEngine):
            raise ConfigError("this vLLM engine was not started with weight_transfer_config={'backend': 'weightsync'}"
                              f" (its weight-transfer engine is {type(engine).__name__})")
        return engine

    def weightsync_prepare(self, engine: Mapping[str, Any], node_id: str, host_ip: str) -> WorkerMetadata:
        metadata: WorkerMetadata = self._weightsync().prepare(engine=engine, node_id=node_id, host_ip=host_ip)
        return metadata

    def weightsync_finalize(self) -> None:
        self._weightsync().finalize()

    def weightsync_close(self) -> None:
        self._weightsync().shutdown()

    def weightsync_outcome(self) -> dict[str, Any]:
        """The last update's outcome: ``{"report": TransferReport as a dict}`` or ``{"error": ...}``."""
        outcome: dict[str, Any] = self._weightsync().outcome
        return outcome

    def weightsync_parameters(self) -> dict[str, list[int]]:
        """The shape of every parameter vLLM holds now (a repacked CPU linear layer shows an empty weight)."""
        model = getattr(self, "model_runner").get_model()
        return {name: list(param.shape) for name, param in model.named_parameters()}
