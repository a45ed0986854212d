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

import math
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence

import msgspec
import torch

from weightsync.api.config import BUCKET_ALIGNMENT
from weightsync.api.errors import (
    DuplicateTensorError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
    WeightStreamError,
    WeightsyncError,
)
from weightsync.core.wire.blocks import BlockPlan, Blocks, block_packing, blocks_of
from weightsync.core.wire.carriers import carried_span
from weightsync.core.wire.codec import MAX_NAME_BYTES, TensorMeta
from weightsync.core.wire.layout import PIECE_BYTES, PlannedBucket
from weightsync.core.wire.partplans import Box
from weightsync.core.wire.sources import as_shard, shard_range
from weightsync.core.wire.tensors import DTYPE_NAMES, COMPLEX_NAMES, as_byte_view, contiguous_source, dtype_name

__all__ = ["plan_buckets", "validate_item", "validate_pair", "PIPELINE_TENSORS"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""The tensor types the planner's common case takes as they are (a subclass, a ``DTensor`` among them, is checked
by ``validate_item``)."""

PIPELINE_TENSORS = 1024
"""A bucket is closed once it lists this many tensors, even with room left: a stream of many small tensors then
still moves as several buckets, so packing, transfer and unpacking overlap instead of running one after another
(far below the wire's ``MAX_TENSORS_PER_BUCKET``; docs/performance.md has the measured alternatives)."""


def validate_pair(item: object, *, devices: frozenset[str], seen: set[str]) -> tuple[str, torch.Tensor]:
    """Check one stream item of an engine that moves whole tensors; return it as ``(name, tensor)`` or raise a
    ``WeightStreamError`` subclass (a shard, too: :mod:`weightsync.api.sources`)."""
    name, tensor, shard = validate_item(item, devices=devices, seen=seen)
    if shard is not None:
        raise WeightStreamError(f"the weights stream yielded a shard of {name!r}; this engine moves whole tensors "
                                "(sharded sources go through the bucket engines: shm, and those built on core)")
    return name, tensor


Sharded = tuple[tuple[int, ...], int, int]
"""A shard's place in its tensor: the full shape, the byte its bytes begin at, the full tensor's bytes."""


def validate_item(item: object, *, devices: frozenset[str], seen: set[str]
                  ) -> tuple[str, torch.Tensor, Sharded | None]:
    """Check one stream item; return it as ``(name, tensor, None)``, or for a shard (``Shard``, ``DTensor``) its local
    tensor and its place (:data:`Sharded`), or raise a ``WeightStreamError`` subclass.

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
    shard = as_shard(name, tensor)
    place: Sharded | None = None
    if shard is not None:
        first, _ = shard_range(name, shard)
        tensor = shard.tensor
        place = tuple(shard.shape), first, math.prod(shard.shape) * tensor.element_size()
    if not isinstance(tensor, torch.Tensor):
        raise WeightStreamError(f"the weights stream yielded a {type(tensor).__name__} for {name!r}, not a tensor")
    if tensor.layout != torch.strided:
        raise UnsupportedDtypeError(f"tensor {name!r} has layout {tensor.layout}; only dense tensors move")
    dtype_name(tensor.dtype)  # raises UnsupportedDtypeError
    if not (tensor.is_cpu and "cpu" in devices) and tensor.device.type not in devices:
        raise UnsupportedDeviceError(
            f"tensor {name!r} is on {tensor.device}, but weightsync moves tensors on the host or this process's "
            f"accelerator, here: {', '.join(sorted(devices))}"
        )
    if name in seen:
        raise DuplicateTensorError(f"tensor {name!r} appears twice in one update", name=name)
    seen.add(name)
    return name, tensor, place


def plan_buckets(weights: Iterable[object], *, bucket_bytes: int, devices: frozenset[str],
                 blocked: Mapping[str, BlockPlan] | None = None, carry: Mapping[str, Sequence[Box]] | None = None
                 ) -> Iterator[PlannedBucket]:
    """Yield the buckets for ``weights`` lazily; the stream's own exceptions become ``WeightStreamError``; ``blocked``
    and ``carry``: tensors that travel block after block, or only a span of (:func:`_order`). Runs once per tensor, so
    the common item (a tuple of a new ASCII name and a dense tensor on a device this backend serves, whole in the
    open bucket) takes one chain of cheap checks and one append, with the bucket's fields in locals; anything else
    (a shard among them) goes through ``validate_item`` (the precise error) and :func:`_place`."""
    seen: set[str] = set()
    bucket = PlannedBucket()
    items, copies, large, used, payload, completed, count = bucket.items, bucket.copies, bucket.large, 0, 0, 0, 0
    align, host_ok, strided, iterator = BUCKET_ALIGNMENT - 1, "cpu" in devices, torch.strided, iter(weights)
    mask, special = ~align, frozenset(blocked or ()) | frozenset(carry or ())
    while True:
        try:  # the caller's own failures (a gather that raised half-way), typed
            item = next(iterator)
        except StopIteration:
            break
        except WeightsyncError:
            raise
        except Exception as exc:
            raise WeightStreamError(f"the weights stream raised {type(exc).__name__}: {exc}") from exc
        if (type(item) is tuple and len(item) == 2 and type(name := item[0]) is str and name.isascii()
                and 0 < len(name) <= MAX_NAME_BYTES and name not in seen and name not in special
                and type(tensor := item[1]) in _PLAIN and tensor.layout is strided
                and (host_ok and tensor.is_cpu or tensor.device.type in devices)):
            seen.add(name)
            blocks = sharded = span = None
        else:
            name, tensor, sharded = validate_item(item, devices=devices, seen=seen)
            blocks, span = _order(name, tensor, sharded, blocked, carry)
        dtype = DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor.dtype)
        # (Only a complex tensor can carry the conjugate bit; any can carry the negative one.)
        if tensor.is_contiguous() and not tensor.is_neg() and (dtype not in COMPLEX_NAMES or not tensor.is_conj()):
            source = tensor
        else:
            source = contiguous_source(tensor)
        total = source.nbytes
        start = (used + align) & mask  # then the common case: whole in the open bucket
        if total <= bucket_bytes - start and count < PIPELINE_TENSORS and not (blocks or sharded or span):
            item = (TensorMeta(name, dtype, tensor.shape, 0, total, total, start), source, 0)
            items.append(item)
            if total <= PIECE_BYTES and source.is_cpu:
                copies += (start, source.data_ptr(), total)
            else:
                large.append(item)
                if not source.is_cpu:
                    bucket.on_device = True
            used = start + total
            payload += total
            completed += 1
            count += 1
            continue
        bucket.nbytes, bucket.payload_bytes, bucket.completed = used, payload, completed
        bucket = yield from _place(bucket, name, dtype, tensor.shape, source, bucket_bytes, blocks, sharded, span)
        items, copies, large = bucket.items, bucket.copies, bucket.large
        used, payload, completed, count = bucket.nbytes, bucket.payload_bytes, bucket.completed, len(items)
    if count:
        bucket.nbytes, bucket.payload_bytes, bucket.completed = used, payload, completed
        yield bucket


def _order(name: str, tensor: torch.Tensor, sharded: Sharded | None, blocked: Mapping[str, BlockPlan] | None,
           carry: Mapping[str, Sequence[Box]] | None) -> tuple[Blocks | None, tuple[int, int] | None]:
    """How a tensor other than the common case travels: block after block (a host tensor whose plan fits it,
    ``wire.blocks``), and of it only the span of its regions in ``carry`` (``wire.carriers``). A shard travels whole,
    block after block where its tensor does: a block of rows (``Shard(0)``) is then a range of each block."""
    shape = sharded[0] if sharded else tensor.shape
    blocks = blocks_of(blocked.get(name), shape) if blocked and tensor.is_cpu else None
    if sharded:
        if blocks is not None and tuple(tensor.shape[1:]) != tuple(shape[1:]):
            raise WeightStreamError(f"the shard of {name!r} (size {tuple(tensor.shape)} of {tuple(shape)}) is not a "
                                    "block of rows, and the tensor travels block after block: a sharded source sends "
                                    "blocks of rows (Shard(0)) or whole tensors")
        return blocks, None
    span = carried_span(carry.get(name), tensor.shape, tensor.element_size(), blocks, name=name) if carry else None
    return blocks, span


def _place(bucket: PlannedBucket, name: str, dtype: str, shape: torch.Size, source: torch.Tensor,
           bucket_bytes: int, blocks: Blocks | None = None, sharded: Sharded | None = None,
           span: tuple[int, int] | None = None) -> Generator[PlannedBucket, None, PlannedBucket]:
    """Place a tensor that does not fit the open bucket whole: close the bucket rather than split a tensor that fits
    a fresh one (or when it is full), else split it across buckets (a tensor packed as ``blocks``: wherever it goes).
    A shard (``sharded``) travels as the range of its tensor's bytes it holds (an empty one as an empty range), split
    wherever the open bucket ends: its receivers gather a tensor's ranges from every sender anyway, and a bucket
    closed early to keep a shard whole costs its sender a ring slot for a few bytes (between shards that fill a
    bucket each, every other bucket would be a norm's few KiB: half the bytes in flight); packed as ``blocks``, as
    one range of each block (its rows of it). Of a tensor carried in part (``span``, in the order it travels:
    ``wire.carriers``) only those bytes travel, placed as a whole tensor's. Yields the buckets it fills; returns the
    open one, its fields up to date."""
    own, total = tuple(shape), source.nbytes  # (the source's own shape: a shard's is its block of rows)
    shape, first, whole = (torch.Size(sharded[0]), *sharded[1:]) if sharded is not None else (shape, 0, total)
    packed = 0  # where the source's bytes begin in the order a tensor packed block after block travels in
    if span is not None:
        first, total = span[0], span[1] - span[0]
        if blocks is None:
            source = as_byte_view(source)[span[0]:span[1]]
        else:
            packed = span[0]
    # Each range: where it lies in the tensor's bytes as they travel, where in the source's packed bytes, its length.
    ranges = [(first, packed, total)]
    if sharded is not None and blocks is not None:
        count = blocks[1]
        ranges = [(index * whole // count + first // count, index * total // count, total // count)
                  for index in range(count)]
    for first, packed, total in ranges:
        bucket = yield from _place_range(bucket, TensorMeta(name, dtype, shape, first, 0, whole, 0, blocks or (),
                                                            span or ()), own, source, packed, total, bucket_bytes,
                                         whole=sharded is None)
    bucket.completed += 1
    return bucket


def _place_range(bucket: PlannedBucket, meta: TensorMeta, own: tuple[int, ...], source: torch.Tensor, packed: int,
                 total: int, bucket_bytes: int, *, whole: bool) -> Generator[PlannedBucket, None, PlannedBucket]:
    """:func:`_place` for one range of ``total`` bytes of the tensor ``meta`` names, from ``meta.offset`` on in the
    bytes as they travel and ``packed`` on in the source's (``own`` its shape); ``whole``: the tensor's one range,
    which does not split where it fits a fresh bucket."""
    align, offset, blocks = BUCKET_ALIGNMENT - 1, 0, meta.blocks or None
    while True:
        start = (bucket.nbytes + align) & ~align
        room, remaining, count = bucket_bytes - start, total - offset, len(bucket.items)
        if count and (remaining > room and (remaining <= bucket_bytes and offset == 0 and whole or room <= 0)
                      or count >= PIPELINE_TENSORS):
            yield bucket
            bucket = PlannedBucket()
            continue
        take = remaining if remaining <= room else room
        item = (msgspec.structs.replace(meta, offset=meta.offset + offset, nbytes=take, bucket_offset=start), source,
                offset)
        bucket.items.append(item)
        if blocks is not None and take:  # row by row, block after block (an empty piece has no rows: it shares
            # its place in the bucket with the next piece, whose rows these are keyed by)
            bucket.rows[start] = block_packing(own, source.element_size(), blocks, packed + offset,
                                               packed + offset + take)
            bucket.large.append(item)
        elif take <= PIECE_BYTES and source.is_cpu:
            bucket.copies += (start, source.data_ptr() + offset, take)
        else:
            bucket.large.append(item)
            bucket.on_device = bucket.on_device or not source.is_cpu
        bucket.nbytes = start + take
        bucket.payload_bytes += take
        offset += take
        if offset >= total:
            return bucket
        yield bucket
        bucket = PlannedBucket()
