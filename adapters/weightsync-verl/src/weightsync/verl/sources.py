"""verl's shard export as weightsync's sharded source: each rank sends the shards its engine holds, never gathered.

verl 0.9's training engines (fsdp, megatron, torchtitan, veomni) export each parameter's local shard with
``BaseEngine.get_per_tensor_param_shard()``: ``(name, local_shard, ShardSpec)`` triples, the spec carrying the full
shape and where the shard lies (a ``DTensor`` mesh and placements, or an exporter's explicit ``place``). Here each
becomes a :class:`weightsync.api.sources.Shard` (:func:`shards_of`), which weightsync's engines send as the range of
the full tensor it holds (:mod:`weightsync.api.sources`). A spec with a converter to HF tensors (``to_hf_chunk``:
veomni's fused expert stacks) is refused by name: not built. A rank whose block is a replica of a peer's
(``contributes=False``) declares the same box, and weightsync's plan has one holder send it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from verl.workers.engine.spec import BlockPlacement, derive_dtensor_placement

from weightsync.api.errors import WeightStreamError
from weightsync.api.sources import Shard, SourceLayout

__all__ = ["layout_of", "shard_of", "shards_of"]

Exported = Iterable[tuple[str, torch.Tensor, Any]]
"""What ``get_per_tensor_param_shard()`` yields (its generator, the first item of the pair it returns)."""


def shard_of(name: str, local: torch.Tensor, spec: Any) -> Shard:
    """One exported shard as a weightsync :class:`Shard`; a ``WeightStreamError`` naming the tensor for a spec that
    is not a box of the full tensor."""
    if spec.to_hf_chunk is not None or spec.hf_slots is not None:
        raise WeightStreamError(f"{name!r} is exported with a converter to HF tensors (to_hf_chunk): sending such "
                                "shards is not built")
    full = tuple(int(extent) for extent in spec.full_shape)
    place = spec.place if spec.place is not None else derive_dtensor_placement(spec)[0]
    if isinstance(place, BlockPlacement):
        return Shard(tensor=local.reshape(tuple(place.local_shape)), shape=full,
                     start=tuple(int(at) for at in place.global_offset))
    row = math.prod(full[1:])
    if place == 0 and local.numel() == math.prod(full):  # unsharded, or replicated: the whole tensor
        return Shard(tensor=local.reshape(full), shape=full, start=(0,) * len(full))
    if not full or row == 0 or place % row or local.numel() % row:
        raise WeightStreamError(f"{name!r} is exported at flat offset {place} ({local.numel()} elements of "
                                f"{tuple(full)}), which is not a block of whole rows: not built")
    return Shard(tensor=local.reshape((local.numel() // row, *full[1:])), shape=full,
                 start=(place // row, *(0,) * (len(full) - 1)))


def shards_of(exported: Exported) -> Iterator[tuple[str, Shard]]:
    """The export as ``(name, Shard)`` pairs, lazily (what a weightsync engine's ``send_weights`` takes)."""
    for name, local, spec in exported:
        yield name, shard_of(name, local, spec)


def layout_of(exported: Exported) -> SourceLayout:
    """What the export holds (each tensor's full shape and box), declared at ``prepare``; no bytes are read."""
    return SourceLayout.of(shards_of(exported))
