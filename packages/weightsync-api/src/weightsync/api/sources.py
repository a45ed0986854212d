"""Sharded sources: an actor rank that holds only shards of the model sends those, and nothing is gathered.

A trainer that shards its model (FSDP2's ``Shard(0)``, one block of rows of each parameter per rank) would have to
all-gather every parameter before a rank could stream it whole. A **sharded source** streams what it holds instead:
``(name, Shard(...))`` pairs — the local shard, the full tensor's shape and where the shard starts in it — or
``(name, dtensor)`` for a torch ``DTensor``, whose local shard and offsets are read without a collective. Every actor
rank of such an ``actor_wg`` sends its shards at once, and each rollout worker takes what it needs of every rank's
stream: the update is resharded on the way (each worker its part: :mod:`weightsync.api.parts`).

Before any update the senders must say what they hold, so that the driver can check, before any replica is paused,
that every byte a rollout worker needs is held by some actor rank: each rank's :class:`SourceLayout` (every tensor's
full shape and the box the rank holds of it) goes into its ``prepare`` metadata under :data:`SOURCE_KEY`. A source
that can say it is a :class:`ShardedWeightSource` (``source_layout()``); the adapters
declare it for the rank.

What a shard may be: a box of the full tensor that is one contiguous range of its row-major bytes — a block of rows
(``Shard(0)``, the FSDP2 default, even or uneven, possibly empty), or the whole tensor (replicated: one of its
holders sends it). A block of columns is refused by name (not built). Plain data: ``to_dict``/``from_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from weightsync.api.errors import ConfigError
from weightsync.api.parts import Region

if TYPE_CHECKING:
    import torch

__all__ = ["SOURCE_KEY", "Holding", "Shard", "ShardedWeightSource", "SourceLayout", "byte_range"]

SOURCE_KEY = "source"
"""The key of an actor rank's ``prepare`` metadata that holds its :class:`SourceLayout` (as ``to_dict``)."""


def byte_range(shape: Sequence[int], region: Region, itemsize: int = 1) -> tuple[int, int] | None:
    """The range ``[start, end)`` of a row-major tensor's bytes (``itemsize`` per element) that ``region`` covers,
    when it is one contiguous range (a block of rows, the whole tensor, an empty box: ``(0, 0)``); None when it is
    not (a block of columns)."""
    if not region.fits(shape):
        raise ConfigError(f"the region start={region.start} size={region.size} does not fit the shape {tuple(shape)}")
    if 0 in region.size:
        return 0, 0
    # Past the first dimension the box does not span whole, every earlier one must be a single index.
    spanned = len(shape)
    while spanned > 0 and region.start[spanned - 1] == 0 and region.size[spanned - 1] == shape[spanned - 1]:
        spanned -= 1
    if any(size != 1 for size in region.size[:max(spanned - 1, 0)]):
        return None
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(start * stride for start, stride in zip(region.start, strides))
    return first * itemsize, (first + math.prod(region.size)) * itemsize


@dataclass(frozen=True)
class Shard:
    """What a sharded source yields for one tensor (``(name, Shard(...))``): ``tensor`` (this rank's local shard, on
    the host or this process's accelerator) is the box of the full tensor of ``shape`` that starts at ``start``."""

    tensor: torch.Tensor
    shape: tuple[int, ...]
    start: tuple[int, ...]

    @property
    def region(self) -> Region:
        return Region(start=tuple(self.start), size=tuple(self.tensor.shape))


@dataclass(frozen=True)
class Holding:
    """One tensor of a :class:`SourceLayout`: its full ``shape`` and the box of it the rank holds (``region``;
    ``Region.whole(shape)`` for a tensor the rank holds whole)."""

    shape: tuple[int, ...]
    region: Region

    def __post_init__(self) -> None:
        if not self.region.fits(self.shape):
            raise ConfigError(f"a held region start={self.region.start} size={self.region.size} does not fit the "
                              f"shape {self.shape}")


@dataclass(frozen=True)
class SourceLayout:
    """What one actor rank of a sharded ``actor_wg`` holds: every checkpoint tensor of the model (name → its
    :class:`Holding`), in the order the rank streams them."""

    tensors: Mapping[str, Holding] = field(default_factory=dict)

    @classmethod
    def of(cls, shards: Iterable[tuple[str, Shard]]) -> SourceLayout:
        """The layout of a stream of shards (their shapes and boxes; the tensors' bytes are not read)."""
        return cls(tensors={name: Holding(shape=tuple(shard.shape), region=shard.region) for name, shard in shards})

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": {name: [list(held.shape), held.region.to_list()] for name, held in self.tensors.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SourceLayout:
        """The layout ``to_dict`` made; a ``ConfigError`` naming the tensor whose entry is malformed."""
        if not isinstance(data, Mapping) or not isinstance(data.get("tensors"), Mapping):
            raise ConfigError(f"a source layout is a mapping with 'tensors' (name -> [shape, region]), got "
                              f"{data!r:.200}")
        tensors: dict[str, Holding] = {}
        for name, entry in data["tensors"].items():
            try:
                shape, (start, size) = entry
                tensors[str(name)] = Holding(shape=tuple(shape), region=Region(start=tuple(start), size=tuple(size)))
            except (TypeError, ValueError, ConfigError) as exc:
                raise ConfigError(f"source layout: malformed entry of {name!r} ({exc}): {entry!r:.200}") from None
        return cls(tensors=tensors)


@runtime_checkable
class ShardedWeightSource(Protocol):
    """An actor rank that holds shards of the model: ``named_weights`` yields ``(name, Shard)`` or ``(name, DTensor)``
    pairs (and whole tensors it holds, as ``(name, tensor)``), and ``source_layout`` says, without reading a tensor's
    bytes, what they will be. The adapters put the layout in the rank's ``prepare`` metadata (module docstring)."""

    def named_weights(self) -> Iterable[tuple[str, Any]]: ...

    def source_layout(self) -> SourceLayout: ...
