"""Tensors as bytes: the dtypes weightsync moves (by their wire names), and byte views in both directions."""

from __future__ import annotations

import ctypes

import torch

from weightsync.api.errors import UnsupportedDtypeError

__all__ = [
    "DTYPES", "DTYPE_NAMES", "dtype_name", "dtype_from_name", "as_byte_view", "contiguous_source", "memoryview_of",
    "memoryview_at", "COMPLEX_NAMES",
]

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
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
"""Each dtype's wire name."""
COMPLEX_NAMES = frozenset(name for name, dtype in DTYPES.items() if dtype.is_complex)
"""Names of the complex dtypes: the only tensors that can carry the lazy conjugate bit."""


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
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


def contiguous_source(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whose storage, from ``data_ptr()`` on, holds ``tensor``'s row-major bytes: ``tensor`` itself when it
    is already contiguous (the common case, no torch call beyond the checks), else one resolved contiguous copy."""
    if tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
        return tensor
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def memoryview_at(address: int, nbytes: int, *, writable: bool = False) -> memoryview:
    """A memoryview over ``nbytes`` of host memory at ``address``, read-only unless ``writable`` (the caller keeps
    the memory alive)."""
    if nbytes == 0:
        return memoryview(bytearray()) if writable else memoryview(b"")
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    return view if writable else view.toreadonly()


def memoryview_of(tensor: torch.Tensor, *, writable: bool = False) -> memoryview:
    """A memoryview over a contiguous CPU uint8 tensor, without numpy; read-only unless ``writable`` (a socket
    receiving into it). It does not keep ``tensor`` alive: the caller holds the tensor while the view is used (a
    freed tensor's memory may be unmapped)."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
        raise ValueError("memoryview_of needs a contiguous CPU uint8 tensor")
    return memoryview_at(tensor.data_ptr(), tensor.numel(), writable=writable)
