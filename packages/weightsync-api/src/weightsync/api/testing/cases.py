"""The conformance cases: deterministic weight sets that sender and receivers regenerate independently.

Each case is a function of ``(update, bucket_bytes)`` returning ``(name, tensor)`` pairs. The sender sends them;
each receiver builds the same list locally and compares what it received by raw bytes (not ``torch.equal``, which
treats NaNs as unequal and ``-0.0`` as equal to ``0.0``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

__all__ = ["CASES", "PLACEMENTS", "case_tensors", "on_device", "place", "raw_bytes", "resolve_device"]

Weights = list[tuple[str, torch.Tensor]]

_DTYPES = [
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    "float8_e4m3fn", "float8_e5m2",
]


def _generator(case: str, update: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(zlib.crc32(f"{case}/{update}".encode()))
    return generator


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, -0.0 included) of ``dtype``; bools are 0 or 1."""
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).to(torch.bool)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    data = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return data.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype)


def _dtypes(update: int, bucket_bytes: int) -> Weights:
    g = _generator("dtypes", update)
    return [(f"dtype.{name}", _random((17, 5), getattr(torch, name), g))
            for name in _DTYPES if isinstance(getattr(torch, name, None), torch.dtype)]


def _zero_size(update: int, bucket_bytes: int) -> Weights:
    g = _generator("zero_size", update)
    return [
        ("empty.vector", torch.empty(0, dtype=torch.float32)),
        ("before", _random((3, 3), torch.float32, g)),
        ("empty.matrix", torch.empty(4, 0, 3, dtype=torch.bfloat16)),
        ("scalar", _random((), torch.float64, g)),
        ("after", _random((5,), torch.int64, g)),
    ]


def _non_contiguous(update: int, bucket_bytes: int) -> Weights:
    g = _generator("non_contiguous", update)
    base = _random((33, 65), torch.float32, g)
    image = _random((2, 3, 4, 5), torch.float16, g).to(memory_format=torch.channels_last)
    return [
        ("transposed", base.t()),
        ("strided", _random((200,), torch.int32, g)[::3]),
        ("column", base[:, 7]),
        ("expanded", _random((1, 9), torch.bfloat16, g).expand(4, 9)),
        ("channels_last", image),
    ]


def _three_buckets(update: int, bucket_bytes: int) -> Weights:
    g = _generator("three_buckets", update)
    elements = (3 * bucket_bytes + 1000) // 4
    return [
        ("small.before", _random((100,), torch.float16, g)),
        ("huge", _random((elements,), torch.float32, g)),
        ("small.after", _random((7, 7), torch.bfloat16, g)),
    ]


def _many_small(update: int, bucket_bytes: int) -> Weights:
    g = _generator("many_small", update)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    return [(f"layers.{i}.bias", _random((16 + i % 85,), dtypes[i % len(dtypes)], g)) for i in range(1000)]


def _long_names(update: int, bucket_bytes: int) -> Weights:
    """Names near the 1024-byte limit, multi-byte UTF-8 included: a bucket's table runs to hundreds of KiB."""
    g = _generator("long_names", update)
    return [(f"{i:04d}." + "é" * 300 + "w" * 300, _random((3, 5), torch.float32, g)) for i in range(400)]


def _mixed(update: int, bucket_bytes: int) -> Weights:
    g = _generator("mixed", update)
    weights: Weights = []
    for layer in range(6):
        weights.append((f"model.layers.{layer}.self_attn.q_proj.weight", _random((64, 96), torch.bfloat16, g)))
        weights.append((f"model.layers.{layer}.mlp.up_proj.weight", _random((96, 160), torch.float32, g)))
        weights.append((f"model.layers.{layer}.input_layernorm.weight", _random((96,), torch.float32, g)))
    weights.append(("lm_head.weight", _random((bucket_bytes // 4 + 77,), torch.float32, g)))
    return weights


def _partial(update: int, bucket_bytes: int) -> Weights:
    """A subset of ``mixed`` (every third tensor): an update need not carry the whole model."""
    return _mixed(update, bucket_bytes)[::3]


def _delta(update: int, bucket_bytes: int) -> Weights:
    """Versions of one model each differing from the base in about 1 % of its elements (another 1 % each update):
    consecutive versions differ in about 2 %, in bf16, fp32, fp8 and int8, one tensor two buckets long."""
    base = _generator("delta", 0)
    changes = _generator("delta.changes", update)
    shapes = [(((2 * bucket_bytes + 300) // 2,), torch.bfloat16), ((96, 160), torch.float32),
              ((128, 64), torch.float8_e4m3fn), ((1000,), torch.int8), ((5,), torch.float32)]
    weights: Weights = []
    for index, (shape, dtype) in enumerate(shapes):
        tensor = _random(shape, dtype, base)
        if update:
            units = tensor.reshape(-1).view(torch.uint8).view(-1, tensor.element_size())
            chosen = torch.rand(units.shape[0], generator=changes) < 0.01
            units[chosen, 0] ^= 1 + update % 255  # its lowest byte: a change in every chosen element
        weights.append((f"delta.{index}", tensor))
    return weights


CASES: dict[str, Callable[[int, int], Weights]] = {
    "dtypes": _dtypes,
    "zero_size": _zero_size,
    "non_contiguous": _non_contiguous,
    "three_buckets": _three_buckets,
    "many_small": _many_small,
    "long_names": _long_names,
    "mixed": _mixed,
    "partial": _partial,
    "delta": _delta,
}


def case_tensors(case: str, update: int, bucket_bytes: int) -> Weights:
    try:
        return CASES[case](update, bucket_bytes)
    except KeyError:
        raise ValueError(f"unknown conformance case {case!r}; known: {', '.join(CASES)}") from None


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's logical contents as flat uint8 (row-major), whatever its strides."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return flat.view(torch.uint8).cpu()


PLACEMENTS = ("device", "mixed")
"""Where a case's tensors live when the kit runs on an accelerator: all on it, or alternately on it and the host."""


def resolve_device(spec: str) -> str:
    """The device type a kit run uses: ``spec`` itself (``"cpu"``, ``"cuda"``), or, for ``"module:function"``, what
    that function returns when called in the calling process (it registers the device there first, as an emulated
    accelerator's ``install()`` does; every worker process calls it)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep:
        return spec
    import importlib

    function = getattr(importlib.import_module(module_name), attribute)
    return str(function())


def on_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """``tensor`` on ``device`` with its shape, strides and storage offset: a non-contiguous view stays one."""
    if tensor.device.type == torch.device(device).type:
        return tensor
    if tensor.is_contiguous():
        return tensor.to(device)
    storage = tensor.untyped_storage().nbytes() // tensor.element_size()
    base = tensor.as_strided((storage,), (1,), 0).to(device)
    return base.as_strided(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


def place(weights: Weights, device: str, placement: str) -> Weights:
    """A case's tensors on ``device`` (``placement="device"``), or every other one there (``"mixed"``)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if device == "cpu":
        return weights
    return [(name, on_device(tensor, device) if placement == "device" or index % 2 == 0 else tensor)
            for index, (name, tensor) in enumerate(weights)]
