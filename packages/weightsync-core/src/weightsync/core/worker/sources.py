"""A sharded module as an actor rank's source: :class:`ModuleShards` streams what this rank holds of a module whose
parameters are torch ``DTensor``s (FSDP2's ``fully_shard``: ``Shard(0)`` over the mesh), without gathering any.

Each parameter goes as its local shard and where that lies (:class:`~weightsync.api.sources.Shard`, read from the
``DTensor`` without a collective); a parameter that is not a ``DTensor`` (a module left unwrapped) is held whole by
every rank, and one of them sends it. Before streaming, and before saying its layout, every FSDP module in the tree is
resharded (``FSDPModule.reshard()``: a module kept unsharded after its forward, ``reshard_after_forward=False``,
holds gathered parameters until then; resharding frees them, and sends nothing over the trainer's fabric).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from weightsync.api.errors import WeightStreamError
from weightsync.api.sources import Shard, SourceLayout
from weightsync.core.wire.sources import as_shard, shard_range

__all__ = ["ModuleShards"]


class ModuleShards:
    """A ``ShardedWeightSource`` over ``module``'s parameters (and, with ``buffers``, its persistent buffers), named
    as ``named_parameters`` names them, or as ``rename`` maps those names (checkpoint names for an inference engine).
    ``dtype``: each floating-point shard cast to it as it is streamed (a mixed-precision trainer's fp32 masters sent
    as bf16).
    """

    def __init__(self, module: torch.nn.Module, *, buffers: bool = False,
                 rename: Callable[[str], str] | None = None, dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.buffers = buffers
        self.rename = rename
        self.dtype = dtype

    def named_weights(self) -> Iterator[tuple[str, Shard | torch.Tensor]]:
        self._reshard()
        for name, tensor in self._tensors():
            shard = as_shard(name, tensor)
            if shard is None:
                yield name, self._cast(tensor.detach())
            else:
                yield name, Shard(tensor=self._cast(shard.tensor.detach()), shape=shard.shape, start=shard.start)

    def source_layout(self) -> SourceLayout:
        self._reshard()
        shards: list[tuple[str, Shard]] = []
        for name, tensor in self._tensors():
            shard = as_shard(name, tensor) or Shard(tensor=tensor, shape=tuple(tensor.shape),
                                                    start=(0,) * tensor.dim())
            shard_range(name, shard)  # a box that is not a block of rows is refused here, before any update
            shards.append((name, shard))
        return SourceLayout.of(shards)

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in ``dtype`` where it is a floating-point one (an integer buffer keeps its dtype)."""
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        named: list[tuple[str, torch.Tensor]] = list(self.module.named_parameters())
        if self.buffers:
            named += [(name, buffer) for name, buffer in self.module.named_buffers()
                      if _persistent(self.module, name)]
        for name, tensor in named:
            renamed = self.rename(name) if self.rename is not None else name
            if renamed in seen:
                raise WeightStreamError(f"two tensors of the module are named {renamed!r}")
            seen.add(renamed)
            yield renamed, tensor

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for submodule in self.module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.reshard()


def _persistent(module: torch.nn.Module, name: str) -> bool:
    owner_name, _, buffer = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return buffer not in owner._non_persistent_buffers_set
