"""Every call the ``kimi`` backend makes into checkpoint-engine, zmq and CUDA, behind one object.

The engine holds a :class:`CheckpointEngineLibrary` (``KimiCheckpointEngine.library``) and reaches
checkpoint-engine only through it, so the tests run the whole lifecycle on a CPU machine with a fake library in its
place. It is also the one place that knows the ParameterServer's group is the process's default
``torch.distributed`` group (:meth:`CheckpointEngineLibrary.default_group_in_use`,
:meth:`~CheckpointEngineLibrary.all_reduce_sum`, :meth:`~CheckpointEngineLibrary.destroy_process_group`).
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, Protocol

import torch

from weightsync.api.errors import BackendUnavailableError
from weightsync.kimi.mapping import Weights
from weightsync.kimi.spec import CHECKPOINT_ENGINE_HINT

__all__ = ["CheckpointEngineLibrary", "ParameterServer", "RequestFunction"]

RequestFunction = Callable[[list[tuple[str, str]]], None]
"""``update``'s ``req_func``: called with ``(device uuid, ZMQ address)`` pairs, one per GPU of the world."""


class ParameterServer(Protocol):
    """The part of ``checkpoint_engine.ps.ParameterServer`` (0.4.2) we call (checkpoint-engine ships no types)."""

    def init_process_group(self, *, timeout: datetime.timedelta) -> None: ...

    def register_checkpoint(self, checkpoint_name: str, *, named_tensors: dict[str, torch.Tensor],
                            use_shared_memory_pool: bool = False) -> None: ...

    def gather_metas(self, checkpoint_name: str) -> None: ...

    def update(self, checkpoint_name: str, req_func: RequestFunction, *, timeout: datetime.timedelta,
               ranks: list[int] | None = None) -> None: ...

    def unregister_checkpoint(self, checkpoint_name: str, force: bool = False) -> None: ...


def _import(module: str) -> Any:
    """Import a module checkpoint-engine needs, turning its absence into the registry's kind of error."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} does not import ({exc}); {CHECKPOINT_ENGINE_HINT}"
        raise BackendUnavailableError(f"weightsync backend 'kimi' cannot run here: {reason}", backend="kimi",
                                      reason=reason) from None


class CheckpointEngineLibrary:
    """checkpoint-engine itself. ``ps_rank`` arguments name this worker's ParameterServer rank."""

    def p2p_available(self) -> bool:
        """Whether ``mode="p2p"`` can run here (checkpoint-engine pulls through Mooncake)."""
        return importlib.util.find_spec("mooncake") is not None

    def default_group_in_use(self) -> bool:
        """Whether this process already has a default ``torch.distributed`` group (the PS would take it over)."""
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def new_parameter_server(self, **kwargs: Any) -> ParameterServer:
        server: ParameterServer = _import("checkpoint_engine.ps").ParameterServer(**kwargs)
        return server

    def device(self, *, ps_rank: int) -> torch.device:
        # The PS uses device ``rank % visible GPUs`` (set_device in its constructor); so do we.
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return torch.device("cuda", ps_rank % count) if count else torch.device("cuda", 0)

    def device_uuid(self, *, ps_rank: int) -> str:
        """How checkpoint-engine names this GPU in the IPC socket paths it hands to ``req_func``."""
        return f"GPU-{torch.cuda.get_device_properties(self.device(ps_rank=ps_rank)).uuid!s}"

    def all_reduce_sum(self, values: list[int], *, ps_rank: int) -> list[int]:
        """Sum ``values`` over the PS group (its default group: checkpoint-engine's own ``all_reduce``)."""
        ce_dist = _import("checkpoint_engine.distributed")
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device(ps_rank=ps_rank))
        ce_dist.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return [int(value) for value in tensor.cpu().tolist()]

    def serve_ipc(self, handle: str, run: Callable[[Weights], None], *, ps_rank: int) -> None:
        """Be the inference side of the PS's CUDA-IPC hand-off on ``handle`` (a ZMQ address): ``run`` per bucket."""
        worker = _import("checkpoint_engine.worker")
        context = _import("zmq").Context()
        try:
            worker.update_weights_from_ipc(context, handle, self.device(ps_rank=ps_rank).index or 0, run=run)
        finally:
            context.term()

    def destroy_process_group(self) -> None:
        ce_dist = _import("checkpoint_engine.distributed")
        if ce_dist.is_initialized():
            ce_dist.destroy_process_group()
