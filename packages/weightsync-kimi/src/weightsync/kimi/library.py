"""Every call the ``kimi`` backend makes into checkpoint-engine, zmq and CUDA, behind one object.

The engine holds a :class:`CheckpointEngineLibrary` (``KimiCheckpointEngine.library``) and reaches
checkpoint-engine only through it, so the tests run the whole lifecycle on a CPU machine with a fake library in its
place. It is also the one place that puts the ParameterServer's collectives on private groups
(:mod:`weightsync.kimi.groups`) instead of the process's default ``torch.distributed`` group
(:meth:`CheckpointEngineLibrary.join_group`, :meth:`~CheckpointEngineLibrary.all_reduce_sum`,
:meth:`~CheckpointEngineLibrary.destroy_process_group`).
"""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any, Protocol

import torch

from weightsync.api.errors import BackendUnavailableError
from weightsync.kimi.groups import PrivateGroups
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
        raise _unavailable(f"{module} does not import ({exc}); {CHECKPOINT_ENGINE_HINT}") from None


def _unavailable(reason: str) -> BackendUnavailableError:
    return BackendUnavailableError(f"weightsync backend 'kimi' cannot run here: {reason}", backend="kimi",
                                   reason=reason)


@functools.cache
def _private_groups_class(distributed: type) -> type[PrivateGroups]:
    """:class:`PrivateGroups` as a subclass of checkpoint-engine's ``Distributed`` ABC: building it raises if that
    ABC gained a method we do not implement (a checkpoint-engine other than 0.4.2)."""
    combined: type[PrivateGroups] = type("PrivateGroupsDistributed", (PrivateGroups, distributed), {})
    return combined


class CheckpointEngineLibrary:
    """checkpoint-engine itself. ``ps_rank`` arguments name this worker's ParameterServer rank."""

    def __init__(self) -> None:
        self.groups: PrivateGroups | None = None
        """This epoch's private groups, installed in checkpoint-engine by :meth:`join_group`."""
        self._previous: Any = None

    def p2p_available(self) -> bool:
        """Whether ``mode="p2p"`` can run here (checkpoint-engine pulls through Mooncake)."""
        return importlib.util.find_spec("mooncake") is not None

    def new_parameter_server(self, **kwargs: Any) -> ParameterServer:
        server: ParameterServer = _import("checkpoint_engine.ps").ParameterServer(**kwargs)
        return server

    def join_group(self, server: ParameterServer, *, timeout: datetime.timedelta) -> None:
        """``server.init_process_group`` with checkpoint-engine's collectives routed to private groups (see
        :mod:`weightsync.kimi.groups`) until :meth:`destroy_process_group`; the default group is never touched."""
        self.destroy_process_group()  # a previous epoch's, if still standing
        base = _import("checkpoint_engine.distributed.base")
        groups = self._new_groups(base)  # checks what it replaces first
        self._previous, self.groups = base._BACKEND_INSTANCE, groups
        setattr(base, "_BACKEND_INSTANCE", groups)
        try:
            server.init_process_group(timeout=timeout)
        except BaseException:
            self.destroy_process_group()
            raise

    @staticmethod
    def _new_groups(base: Any) -> PrivateGroups:
        current = getattr(base, "_BACKEND_INSTANCE", None)
        distributed = getattr(base, "Distributed", None)
        if not isinstance(distributed, type) or not isinstance(current, distributed):
            raise _unavailable("checkpoint_engine.distributed has no process-wide Distributed implementation to "
                               f"replace (is it not checkpoint-engine 0.4.2?); {CHECKPOINT_ENGINE_HINT}")
        if isinstance(current, PrivateGroups) and current.is_initialized():
            raise _unavailable("another kimi engine of this process holds checkpoint-engine's (process-wide) "
                               "collectives for its epoch; run one kimi engine per process")
        try:
            return _private_groups_class(distributed)()
        except TypeError as exc:  # an abstract method we do not implement
            raise _unavailable(f"checkpoint-engine's Distributed interface changed ({exc}); {CHECKPOINT_ENGINE_HINT}"
                               ) from None

    def device(self, *, ps_rank: int) -> torch.device:
        # The PS uses device ``rank % visible GPUs`` (set_device in its constructor); so do we.
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return torch.device("cuda", ps_rank % count) if count else torch.device("cuda", 0)

    def device_uuid(self, *, ps_rank: int) -> str:
        """How checkpoint-engine names this GPU in the IPC socket paths it hands to ``req_func``."""
        return f"GPU-{torch.cuda.get_device_properties(self.device(ps_rank=ps_rank)).uuid!s}"

    def all_reduce_sum(self, values: list[int], *, ps_rank: int) -> list[int]:
        """Sum ``values`` over the PS world (its private group, on the group's device)."""
        groups = self.groups
        if groups is None or not groups.is_initialized():
            raise RuntimeError("kimi: all_reduce_sum before the ParameterServer joined its group")
        tensor = torch.tensor(values, dtype=torch.int64, device=groups.device)
        groups.all_reduce(tensor, torch.distributed.ReduceOp.SUM)
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
        """Destroy this epoch's private groups and give checkpoint-engine back the implementation it had before."""
        groups, previous = self.groups, self._previous
        self.groups = self._previous = None
        if groups is None:
            return
        try:
            groups.destroy_process_group()
        finally:
            base = _import("checkpoint_engine.distributed.base")
            if getattr(base, "_BACKEND_INSTANCE", None) is groups:
                setattr(base, "_BACKEND_INSTANCE", previous)
