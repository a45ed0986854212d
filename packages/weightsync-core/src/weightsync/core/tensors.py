"""Tensors as bytes: the dtypes weightsync moves, and byte views in both directions."""

from __future__ import annotations

import ctypes

import torch

from weightsync.api.errors import UnsupportedDtypeError

__all__ = ["DTYPES", "dtype_name", "dtype_from_name", "as_byte_view", "memoryview_of"]

_DTYPE_NAMES = [
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128",
    "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
]
# Only dtypes this torch build has; a name from a peer that is not in this table is rejected, never getattr'd.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise UnsupportedDtypeError(f"dtype {dtype} cannot be moved by weightsync") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise UnsupportedDtypeError(f"unknown dtype name {name!r}") from None


def as_byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a view when already contiguous, else one contiguous copy)."""
    flat = tensor.detach()
    if flat.is_conj():
        flat = flat.resolve_conj()
    if flat.is_neg():
        flat = flat.resolve_neg()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    flat = flat.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    return flat.view(torch.uint8)


def memoryview_of(tensor: torch.Tensor) -> memoryview:
    """A read-only memoryview over a contiguous CPU uint8 tensor, without numpy."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise ValueError("memoryview_of needs a contiguous CPU uint8 tensor")
    length = tensor.numel()
    if length == 0:
        return memoryview(b"")
    buffer = (ctypes.c_char * length).from_address(tensor.data_ptr())
    return memoryview(buffer).cast("B").toreadonly()
