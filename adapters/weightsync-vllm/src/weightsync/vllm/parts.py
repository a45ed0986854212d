"""A vLLM worker's part, recorded from vLLM's own loaders (``weightsync.api.parts``).

Once per engine, each worker drives its model's own ``load_weights`` with a stand-in for every checkpoint tensor
(:class:`IndexTensor`: the checkpoint tensor's shape and dtype, and for data the index of each of its elements). The
loaders narrow, view, chunk and transpose the stand-ins as they would the real tensors — those operations run on the
indices — and where a loader copies one into the model, the copy is recorded instead (nothing is written): the
indices it would have copied are the elements of that checkpoint tensor the worker keeps. Each copy's indices that
form a box become a :class:`~weightsync.api.parts.Region` (fused ``qkv_proj`` / ``gate_up_proj`` included: each of
q, k, v is a box of its own checkpoint tensor); a tensor whose loader computes on its data (arithmetic, a cast of
values) or takes what is not a box (a gather of scattered rows) is kept whole, and the part lists it in
``fallbacks``. A loader that reads values to decide (``.item()``) makes the recording fail as a whole
(:class:`Unrecordable`): the worker then declares no part and receives the whole model.

The model is in vLLM's loadable form while the loaders run (its layerwise reload, the model on the meta device, the
loaders unwrapped) and restored afterwards: ``weightsync.vllm.internals.loadable``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from weightsync.api.parts import Part, Region

__all__ = ["IndexTensor", "checkpoint_shapes", "record_part"]

_VIEWS = frozenset({
    torch.Tensor.narrow, torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.__getitem__, torch.Tensor.unsqueeze,
    torch.Tensor.squeeze, torch.Tensor.transpose, torch.Tensor.t, torch.Tensor.permute, torch.Tensor.flatten,
    torch.Tensor.contiguous, torch.Tensor.chunk, torch.Tensor.split, torch.Tensor.unbind, torch.Tensor.select,
    torch.Tensor.expand, torch.Tensor.clone, torch.Tensor.detach, torch.narrow, torch.reshape, torch.transpose,
    torch.chunk, torch.split, torch.unbind, torch.squeeze, torch.unsqueeze, torch.flatten, torch.select,
})
"""Operations that move elements without computing on them: run on the indices."""
_CASTS = frozenset({torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                    torch.Tensor.double, torch.Tensor.cpu})
"""Operations that change a tensor's dtype or device, not which element is where."""


class Unrecordable(Exception):
    """A loader did something with a checkpoint tensor's stand-in whose result has no shape to go on with (it reads
    its values: ``.item()``, a comparison that decides a branch)."""


class _Computed(Exception):
    """A stand-in reached an operation that computes on its data (raised by the dispatch, caught at the top)."""


class IndexTensor(torch.Tensor):
    """A checkpoint tensor's stand-in (module docstring): metadata of the checkpoint tensor, no storage of its own;
    ``positions`` holds, for each element, its flat index in the checkpoint tensor — None once a loader computed on
    it (what it copies then counts as the whole checkpoint tensor)."""

    positions: torch.Tensor | None
    checkpoint: str
    copies: list[tuple[str, torch.Tensor | None]]

    @staticmethod
    def __new__(cls, positions: torch.Tensor | None, *, shape: torch.Size, dtype: torch.dtype, checkpoint: str,
                copies: list[tuple[str, torch.Tensor | None]]) -> IndexTensor:
        made: IndexTensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=torch.device("cpu"),
                                                                requires_grad=False)
        made.positions, made.checkpoint, made.copies = positions, checkpoint, copies
        return made

    def _child(self, positions: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype | None = None
               ) -> IndexTensor:
        return IndexTensor(positions, shape=shape, dtype=dtype or self.dtype, checkpoint=self.checkpoint,
                           copies=self.copies)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and isinstance(source := args[1] if len(args) > 1 else kwargs.get("src"), cls):
            source.copies.append((source.checkpoint, source.positions))
            return args[0]  # recorded, not written
        if func is torch.Tensor.__setitem__ and len(args) == 3 and isinstance(args[2], cls):
            args[2].copies.append((args[2].checkpoint, args[2].positions))
            return None
        stand_in = args[0] if args and isinstance(args[0], cls) else None
        if stand_in is not None and stand_in.positions is not None and func in _VIEWS:
            with torch._C.DisableTorchFunctionSubclass():
                result = func(stand_in.positions, *args[1:], **kwargs)
            if isinstance(result, torch.Tensor):
                return stand_in._child(result, result.shape)
            return type(result)(stand_in._child(item, item.shape) for item in result)
        if stand_in is not None and func in _CASTS:
            meta = _on_meta(func, args, kwargs)
            return stand_in._child(stand_in.positions, meta.shape, meta.dtype)
        try:
            with torch._C.DisableTorchFunctionSubclass():  # metadata (shape, dtype, size()): the stand-in's own
                return func(*args, **kwargs)
        except _Computed:
            pass
        # A computation on the data (or a view of a stand-in computed on before): its result's geometry from meta
        # tensors, its positions lost.
        source = next(arg for arg in (*args, *kwargs.values()) if isinstance(arg, cls))
        result = _on_meta(func, args, kwargs)
        if isinstance(result, torch.Tensor):
            return source._child(None, result.shape, result.dtype)
        if isinstance(result, (tuple, list)) and all(isinstance(item, torch.Tensor) for item in result):
            return type(result)(source._child(None, item.shape, item.dtype) for item in result)
        raise Unrecordable(f"{func} on {source.checkpoint} gives {type(result).__name__}")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None  # type: ignore[override]
                           ) -> Any:
        raise _Computed(str(func))


def _on_meta(func: Any, args: Any, kwargs: Any) -> Any:
    """``func`` on meta tensors of the same geometry as its tensor arguments (stand-ins included)."""
    from torch.utils._pytree import tree_map

    def meta(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        return value

    with torch._C.DisableTorchFunctionSubclass():
        try:
            return func(*tree_map(meta, args), **tree_map(meta, kwargs))
        except Exception as exc:  # noqa: BLE001 - what the loader asked of the data cannot be had without it
            names = sorted({arg.checkpoint for arg in (*args, *kwargs.values()) if isinstance(arg, IndexTensor)})
            raise Unrecordable(f"{func} on {', '.join(names)}: {exc}") from None


def checkpoint_shapes(directory: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of the safetensors checkpoint in ``directory`` (the model vLLM started from): its shape and
    dtype, read from the files' headers."""
    import pathlib

    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for path in sorted(pathlib.Path(directory).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shapes[name] = (tuple(piece.get_shape()), _DTYPES[piece.get_dtype()])
    return shapes


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def stand_ins(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
              copies: list[tuple[str, torch.Tensor | None]]) -> Iterator[tuple[str, IndexTensor]]:
    for name, (shape, dtype) in shapes.items():
        positions = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
        yield name, IndexTensor(positions, shape=positions.shape, dtype=dtype, checkpoint=name, copies=copies)


def box_of(index: torch.Tensor, shape: tuple[int, ...]) -> Region | None:
    """The box of the checkpoint tensor (of ``shape``) whose elements ``index`` holds, each once; None when they do
    not form one."""
    flat = index.reshape(-1)
    if flat.numel() == 0:
        return Region(start=(0,) * len(shape), size=(0,) * len(shape))
    coordinates = []
    rest = flat
    for extent in reversed(shape):
        coordinates.append(rest % extent)
        rest = rest // extent
    coordinates.reverse()
    start = tuple(int(axis.min()) for axis in coordinates)
    size = tuple(int(axis.max()) - low + 1 for axis, low in zip(coordinates, start))
    if math.prod(size) != flat.numel():
        return None
    seen = torch.zeros(math.prod(shape), dtype=torch.bool)
    seen[flat] = True
    region = Region(start=start, size=size)
    inside = seen.reshape(shape)[region.slices()]
    return region if bool(inside.all()) else None


def regions(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
            copies: list[tuple[str, torch.Tensor | None]]) -> Part:
    """The part the recorded copies describe: each checkpoint tensor's boxes (none copied: nothing of it), whole
    where a copy was not a box or was computed."""
    boxes: dict[str, list[Region]] = {name: [] for name in shapes}
    whole: set[str] = set()
    for name, positions in copies:
        box = box_of(positions, shapes[name][0]) if positions is not None else None
        if box is None:
            whole.add(name)
        else:
            boxes[name].append(box)
    kept = {name: tuple(found) for name, found in boxes.items()
            if name not in whole and not (len(found) == 1 and found[0] == Region.whole(shapes[name][0]))}
    return Part(tensors=kept, fallbacks=tuple(sorted(whole)))


def record_part(model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> Part:
    """Drive ``model``'s own ``load_weights`` with stand-ins of ``shapes`` and return the part it keeps (module
    docstring); the caller has made the model loadable (``weightsync.vllm.internals.loadable``)."""
    copies: list[tuple[str, torch.Tensor | None]] = []
    model.load_weights(weights=stand_ins(shapes, copies))  # type: ignore[operator]
    return regions(shapes, copies)
