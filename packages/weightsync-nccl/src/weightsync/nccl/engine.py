"""Backend ``nccl``: the collective transport on CUDA device buckets, in a private ``ProcessGroupNCCL``.

The group is built as ``ProcessGroupNCCL(PrefixStore(epoch, TCPStore), rank, size, options)`` — never through
``torch.distributed.init_process_group`` — so it coexists with the trainer's (FSDP/Megatron) or the inference
engine's default group in the same process. Everything else (streams, events, device rings, node-local senders) is
weightsync-core's :class:`~weightsync.core.backend.AcceleratorCollectiveTransport`.
"""

from __future__ import annotations

import datetime
from typing import Any, ClassVar

import torch

from weightsync.core.backend import AcceleratorCollectiveTransport, c10d, engine_class
from weightsync.nccl.spec import cuda_reason

__all__ = ["NcclCheckpointEngine", "NcclTransport"]


class NcclTransport(AcceleratorCollectiveTransport):
    """Broadcast of CUDA device buckets over NCCL. Options: ``device_index``, ``relays`` (see the transport)."""

    name: ClassVar[str] = "nccl"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    device_type: ClassVar[str] = "cuda"

    @classmethod
    def missing(cls) -> str | None:
        return cuda_reason()

    def new_group(self, store: Any, rank: int, size: int) -> Any:
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=self.settings.timeout)
        # The trainer's own collectives keep priority: weight sync runs beside, not ahead of, them.
        options.is_high_priority_stream = False
        with torch.cuda.device(self.device):
            return c10d.ProcessGroupNCCL(store, rank, size, options)


NcclCheckpointEngine = engine_class(NcclTransport)
