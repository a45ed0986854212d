"""``WeightsyncWorkerExtension``: the worker methods weightsync calls by name through vLLM's ``collective_rpc``.

vLLM mixes the class named by ``worker_extension_cls`` into its worker class, so these run in each worker process,
next to the model and the ``WeightsyncTransferEngine`` vLLM built there. They carry what vLLM's weight-transfer API
has no step for: ``prepare`` (which returns data) and reading back the outcome of the last update as plain data.
Engines without weightsync get it too, for :meth:`WeightsyncWorkerExtension.weightsync_reload` (vLLM's own
``reload_weights``, timed) and :meth:`WeightsyncWorkerExtension.weightsync_internals`. Only the worker's public
methods are used here (``get_model``, the weight-update steps, ``reload_weights``); what reaches past them is in
``weightsync.vllm.internals``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.api.types import WorkerMetadata
from weightsync.vllm import internals

__all__ = ["WeightsyncWorkerExtension"]


class WeightsyncWorkerExtension:
    """Mixed into vLLM's worker; ``self`` is the worker."""

    def _weightsync(self) -> Any:
        from weightsync.vllm.engine import engine_in_process

        return engine_in_process()

    def _model(self) -> Any:
        worker: Any = self
        return worker.get_model()

    def weightsync_prepare(self, engine: Sequence[Mapping[str, Any]], node_id: str, host_ip: str,
                           parts: bool = True) -> WorkerMetadata:
        """Prepare this worker's weightsync engine from its entry of ``engine`` (one per worker of vLLM's engine);
        ``parts``: whether a worker of several declares its part (``WeightsyncTransferEngine.prepare``)."""
        metadata: WorkerMetadata = self._weightsync().prepare(engine=engine, node_id=node_id, host_ip=host_ip,
                                                              parts=parts, local_rank=self.weightsync_local_rank())
        return metadata

    def weightsync_local_rank(self) -> int:
        """vLLM's local rank of this worker (its device's index on its node), which picks its rail."""
        worker: Any = self
        return int(worker.local_rank)

    def weightsync_finalize(self) -> None:
        self._weightsync().finalize()

    def weightsync_close(self) -> None:
        self._weightsync().shutdown()

    def weightsync_peer(self, step: str, kwargs: dict[str, Any]) -> Any:
        """A step of the engine this worker serves a joining replica with (``weightsync.vllm.peer``)."""
        return self._weightsync().as_peer(step, kwargs)

    def weightsync_serve(self, version: int) -> None:
        """Start serving the kept copy of ``version`` to a joining replica, in a thread (``weightsync.vllm.peer``)."""
        self._weightsync().serve(version)

    def weightsync_served(self) -> dict[str, Any]:
        """The serve's outcome: ``{"report": ...}``, ``{"error": ...}``, or ``{}`` while it runs."""
        outcome: dict[str, Any] = self._weightsync().serving.outcome
        return outcome

    def weightsync_update(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """One update in one RPC: vLLM's own worker steps ``start_weight_update`` → ``update_weights(update_info)``
        → ``finish_weight_update``, which call the weight-transfer engine's, then the outcome
        (:meth:`weightsync_outcome`; an error of the update is in it rather than raised, as plain data). Three
        round trips through vLLM's engine core fewer than calling the steps one by one."""
        engine = self._weightsync()
        worker: Any = self
        worker.start_weight_update()
        try:
            worker.update_weights(update_info)
        except Exception as exc:  # noqa: BLE001 - it goes back as data, typed (the engine recorded its own errors)
            from weightsync.vllm.engine import error_to_data

            if "error" not in engine.outcome:
                engine.outcome = {"error": error_to_data(exc)}
            return self.weightsync_outcome()
        worker.finish_weight_update()
        return self.weightsync_outcome()

    def weightsync_outcome(self) -> dict[str, Any]:
        """The last update's outcome: ``{"report": TransferReport as a dict}`` or ``{"error": ...}``."""
        outcome: dict[str, Any] = self._weightsync().outcome
        return outcome

    def weightsync_checksums(self) -> dict[str, str]:
        """``weightsync.vllm.engine.parameter_checksums`` of the model vLLM holds now (the proof of load)."""
        from weightsync.vllm.engine import parameter_checksums

        return parameter_checksums(self._model())

    def weightsync_parameters(self) -> dict[str, list[int]]:
        """The shape of every parameter vLLM holds now (a repacked CPU linear layer shows an empty weight)."""
        return {name: list(param.shape) for name, param in self._model().named_parameters()}

    def weightsync_reload(self, weights_path: str) -> dict[str, Any]:
        """vLLM's ``reload_weights(weights_path=..., is_checkpoint_format=True)``, timed: ``seconds`` in all,
        ``read_seconds`` in vLLM's checkpoint iterator (reading the files), ``load_seconds`` the rest (vLLM's own
        load: the same measure as an update's ``load_seconds``); ``notes`` (``weightsync.vllm.internals.notes``):
        where the installed vLLM does not let the loader be observed, the reload is timed whole (``read_seconds``
        0.0)."""
        from weightsync.vllm.engine import LoadClock

        clock = LoadClock()
        worker: Any = self
        with internals.observe_load_weights(self._model(), clock.iterate):  # observed only: vLLM still loads all
            worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        seconds = time.perf_counter() - clock.started
        return {"seconds": seconds, "read_seconds": clock.waited, "load_seconds": seconds - clock.waited,
                "notes": internals.notes("load_weights_hook")}

    def weightsync_internals(self, avoid: list[str] | None = None) -> dict[str, str]:
        """``weightsync.vllm.internals.report()`` in this worker, after ``internals.avoid(avoid)`` when given."""
        if avoid is not None:
            internals.avoid(avoid)
        return internals.report()
