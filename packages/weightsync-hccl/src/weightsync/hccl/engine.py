"""Backend ``hccl``: the collective transport on Ascend NPU device buckets, in a private ``ProcessGroupHCCL``.

The same design as ``nccl`` (see :mod:`weightsync.core.transports.collective.device`): ``torch_npu`` mirrors CUDA's
stream and event API as ``torch.npu``, and its ``ProcessGroupHCCL`` takes the same ``(store, rank, size, options)`` as
``ProcessGroupNCCL``. Unlike verl's HCCL backend this one is not synchronous: copy and communication streams overlap
as on CUDA.

``torch_npu`` is imported when an engine is built, never at module import, and its absence raises
``BackendUnavailableError`` with the install hint (the registry's probe says the same before the engine loads).
"""

from __future__ import annotations

import datetime
import importlib
from typing import Any, ClassVar

import torch

from weightsync.api.errors import BackendUnavailableError
from weightsync.core.backend import AcceleratorCollectiveTransport, engine_class
from weightsync.hccl.spec import npu_reason

__all__ = ["HcclCheckpointEngine", "HcclTransport", "process_group_hccl"]


def process_group_hccl() -> Any:
    """torch_npu's ``ProcessGroupHCCL`` class (a private-module import: torch_npu exposes it nowhere else)."""
    try:
        module = importlib.import_module("torch_npu._C._distributed_c10d")
    except ImportError as exc:
        reason = f"torch_npu's ProcessGroupHCCL is not importable: {exc}"
        raise BackendUnavailableError(f"weightsync backend 'hccl' cannot run here: {reason}", backend="hccl",
                                      reason=reason) from None
    return module.ProcessGroupHCCL


class HcclTransport(AcceleratorCollectiveTransport):
    """Broadcast of NPU device buckets over HCCL. Options: ``device_index``, ``relays`` (see the transport)."""

    name: ClassVar[str] = "hccl"
    devices: ClassVar[frozenset[str]] = frozenset({"npu"})
    device_type: ClassVar[str] = "npu"

    @classmethod
    def missing(cls) -> str | None:
        return npu_reason()  # imports torch_npu, which gives torch its ``npu`` device module

    def new_group(self, store: Any, rank: int, size: int) -> Any:
        group_class = process_group_hccl()
        options = group_class.Options()
        options._timeout = datetime.timedelta(seconds=self.settings.timeout)
        npu: Any = getattr(torch, "npu")
        npu.set_device(self.device)
        return group_class(store, rank, size, options)


HcclCheckpointEngine = engine_class(HcclTransport)
