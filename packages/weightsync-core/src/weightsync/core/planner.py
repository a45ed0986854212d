"""Bucket planning: the one packing loop.

A stream of ``(name, tensor)`` pairs becomes a sequence of buckets of at most ``bucket_bytes`` bytes. Each tensor
starts at a multiple of ``BUCKET_ALIGNMENT`` (so a receiver can view it in its dtype in place). A tensor that fits
an empty bucket is never split: if it does not fit the current bucket's remaining space, the bucket is closed and the
tensor opens the next one. A tensor larger than a bucket fills the current bucket's remaining space and then whole
buckets; its pieces are ``TensorMeta`` ranges of one name, reassembled by the receiver. Any dtype moves as bytes.

The planner also validates the stream, before a byte of it is packed: pairs, names (non-empty, UTF-8, at most
``MAX_NAME_BYTES``), tensors, dtypes, devices, duplicates.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from weightsync.api.config import BUCKET_ALIGNMENT
from weightsync.api.errors import (
    DuplicateTensorError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
    WeightStreamError,
)
from weightsync.core.codec import MAX_NAME_BYTES, TensorMeta
from weightsync.core.tensors import as_byte_view, contiguous_source, dtype_name

__all__ = ["PackItem", "PlannedBucket", "plan_buckets", "validate_pair", "PIPELINE_TENSORS"]

PIPELINE_TENSORS = 1024
"""A bucket is closed once it lists this many tensors, even with room left: a stream of many small tensors then
still moves as several buckets, so packing, transfer and unpacking overlap instead of running one after another
(far below the wire's ``MAX_TENSORS_PER_BUCKET``). 256 was slower here, 512 no faster."""


class PackItem(NamedTuple):
    meta: TensorMeta
    source: torch.Tensor
    """The caller's tensor, or a contiguous copy of it: its storage from ``data_ptr()`` holds the row-major bytes."""
    start: int
    """Byte offset of this piece in ``source``'s bytes (``meta.offset``)."""

    def byte_view(self) -> torch.Tensor:
        """The piece as a flat uint8 tensor (for ``Tensor.copy_`` where raw addresses do not apply)."""
        return as_byte_view(self.source)[self.start:self.start + self.meta.nbytes]


@dataclass
class PlannedBucket:
    items: list[PackItem] = field(default_factory=list)
    nbytes: int = 0
    """Bytes of the bucket's payload (the last piece's end, alignment padding included)."""
    payload_bytes: int = 0
    """Bytes of tensor data in it (padding excluded)."""
    completed: int = 0
    """Tensors whose last piece is in this bucket."""

    def __len__(self) -> int:
        return len(self.items)


def validate_pair(item: object, *, devices: frozenset[str], seen: set[str]) -> tuple[str, torch.Tensor]:
    """Check one stream item; return it as ``(name, tensor)`` or raise a ``WeightStreamError`` subclass.

    Runs once per tensor, so the common case (an ASCII name, a dense tensor) takes only cheap checks.
    """
    if not isinstance(item, tuple) or len(item) != 2:
        raise WeightStreamError(f"the weights stream must yield (name, tensor) pairs, got {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise WeightStreamError(f"tensor names must be non-empty strings, got {name!r}")
    if not (name.isascii() and len(name) <= MAX_NAME_BYTES):
        try:
            encoded = name.encode("utf-8")
        except UnicodeEncodeError:
            raise WeightStreamError(f"tensor name {name!r} is not valid UTF-8") from None
        if len(encoded) > MAX_NAME_BYTES:
            raise WeightStreamError(
                f"tensor name {name[:48]!r}... is {len(encoded)} bytes long (limit {MAX_NAME_BYTES})"
            )
    if not isinstance(tensor, torch.Tensor):
        raise WeightStreamError(f"the weights stream yielded a {type(tensor).__name__} for {name!r}, not a tensor")
    if tensor.layout != torch.strided:
        raise UnsupportedDtypeError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors move")
    dtype_name(tensor.dtype)  # raises UnsupportedDtypeError
    if not (tensor.is_cpu and "cpu" in devices) and tensor.device.type not in devices:
        raise UnsupportedDeviceError(
            f"tensor {name!r} is on {tensor.device}, but this backend moves tensors on: {', '.join(sorted(devices))}"
        )
    if name in seen:
        raise DuplicateTensorError(f"tensor {name!r} appears twice in one update", name=name)
    seen.add(name)
    return name, tensor


def plan_buckets(
    weights: Iterable[object], *, bucket_bytes: int, devices: frozenset[str]
) -> Iterator[PlannedBucket]:
    """Yield the buckets for ``weights`` lazily (the stream is read as buckets are requested).

    Runs once per tensor: for the common tensor (contiguous, whole in one bucket) it stays at a few attribute reads.
    """
    seen: set[str] = set()
    bucket = PlannedBucket()
    mask = ~(BUCKET_ALIGNMENT - 1)
    for item in weights:
        name, tensor = validate_pair(item, devices=devices, seen=seen)
        source = contiguous_source(tensor)
        total = source.nbytes
        dtype = dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        offset = 0
        while True:
            start = (bucket.nbytes + BUCKET_ALIGNMENT - 1) & mask
            room = bucket_bytes - start
            remaining = total - offset
            if bucket.items and (
                remaining > room and (remaining <= bucket_bytes and offset == 0 or room <= 0)
                or len(bucket.items) >= PIPELINE_TENSORS
            ):
                # Close the bucket instead of splitting a tensor that fits a fresh one (or when it is full).
                yield bucket
                bucket = PlannedBucket()
                continue
            take = remaining if remaining <= room else room
            bucket.items.append(PackItem(TensorMeta(name, dtype, shape, offset, take, total, start), source, offset))
            bucket.nbytes = start + take
            bucket.payload_bytes += take
            offset += take
            if offset >= total:
                bucket.completed += 1
                break
            yield bucket
            bucket = PlannedBucket()
    if bucket.items:
        yield bucket
