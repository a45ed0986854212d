"""Where a received tensor goes: the checks a destination passes before a byte is written to it, and a tensor's
bytes seen as the tensor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeGuard

import torch

from weightsync.api.errors import WireError
from weightsync.api.protocols import check_destination as check_tensor_destination
from weightsync.core.wire.blocks import block_view
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.partplans import Box
from weightsync.core.wire.tensors import DTYPES

__all__ = ["Fallback", "check_destination", "copy_regions", "destination_fits", "tensor_of", "typed_view"]

Fallback = Callable[[str, torch.Tensor], object]
"""``copy_into``'s ``fallback(name, tensor)``: where a tensor without a destination goes."""


def destination_fits(destination: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], *,
                     anywhere: bool = False) -> TypeGuard[torch.Tensor]:
    """Whether raw copies can fill ``destination``: ``dtype`` and ``shape``, contiguous, on the host (or, with
    ``anywhere``, on any device), its memory holding the values it shows (not a lazily negated view — even a real
    tensor can be one, a complex tensor's conjugate's ``imag`` — nor a lazily conjugated complex tensor). False for
    no destination."""
    return (destination is not None and destination.dtype is dtype and destination.shape == shape
            and (anywhere or destination.is_cpu) and destination.is_contiguous() and not destination.is_neg()
            and not (dtype.is_complex and destination.is_conj()))


def check_destination(meta: TensorMeta, destination: torch.Tensor) -> None:
    """``DestinationError`` before anything is written when ``destination`` cannot hold the received tensor."""
    check_tensor_destination(meta.name, DTYPES[meta.dtype], meta.shape, destination)


def typed_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes ``data`` (uint8) as the tensor."""
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    return data.view(dtype).reshape(shape)


def tensor_of(data: torch.Tensor, meta: TensorMeta, dtype: torch.dtype, block: int | None) -> torch.Tensor:
    """A whole tensor's bytes ``data`` (uint8) as the tensor; one packed block after block (``meta.blocks``) as a
    full-shape view whose elements inside block ``block`` (the receiving worker's) are that block
    (:func:`~weightsync.core.wire.blocks.block_view`): a ``WireError`` where the worker holds none of its blocks."""
    if not meta.blocks or not data.numel():
        return typed_view(data, dtype, meta.shape)
    if block is None:
        raise WireError(f"{meta.name!r} was sent block by block, and this worker holds none of its blocks: the "
                        "update was not planned for it")
    return block_view(typed_view(data, dtype, (data.numel() // dtype.itemsize,)), meta.shape, meta.blocks, block)


def copy_regions(destination: torch.Tensor, tensor: torch.Tensor, boxes: Sequence[Box] | None) -> None:
    """Copy ``tensor`` into ``destination``; where ``boxes`` are a part's regions of it and ``destination`` has the
    tensor's shape, those alone: outside them the view may be a carrier's zeros or another block's bytes
    (``tensor_of``), and the destination keeps its elements there."""
    with torch.no_grad():  # a model's parameters are valid destinations
        if not boxes or destination.shape != tensor.shape:
            destination.copy_(tensor)
            return
        for start, size in boxes:
            region = tuple(slice(first, first + length) for first, length in zip(start, size))
            destination[region].copy_(tensor[region])
