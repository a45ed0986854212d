"""A rollout worker's part: what it holds of each checkpoint tensor.

A tensor-parallel inference worker keeps a slice of most tensors (a block of rows of ``q_proj``, a block of columns of
``o_proj``, half the vocabulary of ``embed_tokens``) and some whole (norms). A worker that declares its part
(:class:`Part`, in its ``prepare`` metadata under :data:`PART_KEY`) has its update verified by that part: the sender
hashes each distinct part of the update as it sends it, and the worker reads and hashes only its own regions of what it
receives — the rest of the bytes it never touches. A worker that declares nothing holds the whole model, as before.

A part names checkpoint tensors — the names and shapes the actor ranks send, not the engine's fused parameters — and
for each one says one of three things:

* absent from :attr:`Part.tensors`: the whole tensor (a part never makes a worker miss a tensor it did not foresee);
* an empty tuple: nothing of it (the worker has no use for it);
* one or more :class:`Region` boxes: the elements inside any of them. Boxes may overlap (each byte counts once) and be
  strided in memory (a block of columns is a box too).

What several workers' parts share (replicated tensors, k/v heads replicated past the KV head count) is their overlap,
found from the regions; nothing is inferred from names.

Plain data: :meth:`Part.to_dict` and :meth:`Part.from_dict` carry it through Ray and vLLM's RPC; a malformed part is
a ``ConfigError`` naming the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.api.errors import ConfigError

__all__ = ["PART_KEY", "Part", "Region"]

PART_KEY = "part"
"""The key of a worker's ``prepare`` metadata that holds its :class:`Part` (as :meth:`Part.to_dict`)."""


@dataclass(frozen=True)
class Region:
    """A box of one checkpoint tensor: along each dimension ``d``, the indices ``start[d]`` to
    ``start[d] + size[d] - 1``. Its rank must be the tensor's; checked against the tensor's shape when it moves."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.start) != len(self.size):
            raise ConfigError(f"a region's start {self.start} and size {self.size} differ in rank")
        if any(not isinstance(value, int) or isinstance(value, bool) or value < 0
               for value in (*self.start, *self.size)):
            raise ConfigError(f"a region's start {self.start} and size {self.size} must be integers >= 0")

    @classmethod
    def narrow(cls, shape: Sequence[int], dim: int, start: int, length: int) -> Region:
        """The box ``tensor.narrow(dim, start, length)`` takes of a tensor of ``shape``."""
        if not 0 <= dim < len(shape) or start < 0 or length < 0 or start + length > shape[dim]:
            raise ConfigError(f"narrow({dim}, {start}, {length}) does not fit a tensor of shape {tuple(shape)}")
        return cls(start=tuple(start if d == dim else 0 for d in range(len(shape))),
                   size=tuple(length if d == dim else extent for d, extent in enumerate(shape)))

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        return cls(start=(0,) * len(shape), size=tuple(shape))

    def fits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.start) and all(
            start + size <= extent for start, size, extent in zip(self.start, self.size, shape))

    def slices(self) -> tuple[slice, ...]:
        """The box as an index: ``tensor[region.slices()]`` is its elements."""
        return tuple(slice(start, start + size) for start, size in zip(self.start, self.size))

    def to_list(self) -> list[list[int]]:
        return [list(self.start), list(self.size)]


@dataclass(frozen=True)
class Part:
    """What one rollout worker holds of the checkpoint (see the module docstring): ``tensors`` maps a checkpoint
    tensor's name to the regions it keeps (``()``: none of it); a name not in it is held whole. ``fallbacks``: the
    tensors a recorder could not express as regions and left whole, for the report (e.g. a loader that indexes)."""

    tensors: Mapping[str, tuple[Region, ...]] = field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()

    def regions(self, name: str) -> tuple[Region, ...] | None:
        """The regions of ``name`` this part keeps; None for the whole tensor."""
        return self.tensors.get(name)

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": {name: [region.to_list() for region in regions] for name, regions in self.tensors.items()},
                "fallbacks": list(self.fallbacks)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Part:
        """The part :meth:`to_dict` made; a ``ConfigError`` naming the tensor whose regions are malformed."""
        if not isinstance(data, Mapping) or not isinstance(data.get("tensors", {}), Mapping):
            raise ConfigError(f"a part is a mapping with 'tensors' (name -> regions), got {data!r:.200}")
        tensors: dict[str, tuple[Region, ...]] = {}
        for name, regions in data.get("tensors", {}).items():
            try:
                tensors[str(name)] = tuple(Region(start=tuple(start), size=tuple(size)) for start, size in regions)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"part: malformed regions of {name!r} ({exc}): {regions!r:.200}") from None
        fallbacks = data.get("fallbacks", ())
        if not isinstance(fallbacks, Iterable) or isinstance(fallbacks, (str, bytes)):
            raise ConfigError(f"part: 'fallbacks' must list tensor names, got {fallbacks!r:.200}")
        return cls(tensors=tensors, fallbacks=tuple(str(name) for name in fallbacks))

    @classmethod
    def split(cls, shapes: Mapping[str, Sequence[int]], *, dims: Mapping[str, int], rank: int, parts: int) -> Part:
        """Rank ``rank`` of ``parts`` equal slices: each tensor in ``dims`` split along its dimension there (its
        extent divisible by ``parts``), every other tensor of ``shapes`` whole — tensor parallelism's column- and
        row-parallel layers, and a test's or a demo's sharded sink."""
        if not 0 <= rank < parts:
            raise ConfigError(f"rank {rank} is not one of {parts} parts")
        tensors: dict[str, tuple[Region, ...]] = {}
        for name, dim in dims.items():
            if name not in shapes:
                raise ConfigError(f"part: {name!r} is split, but no shape is given for it")
            shape = shapes[name]
            if not 0 <= dim < len(shape) or shape[dim] % parts:
                raise ConfigError(f"part: {name!r} of shape {tuple(shape)} cannot be split {parts} ways along "
                                  f"dimension {dim}")
            length = shape[dim] // parts
            tensors[name] = (Region.narrow(shape, dim, rank * length, length),)
        return cls(tensors=tensors)
