"""A bucket's layout as the sender plans it: its pieces, where each lies in the payload, and how it is copied
(:func:`pack_hashing`: host pieces into a host bucket, hashed in order).

The planner (:mod:`weightsync.core.pipeline.planner`) fills these; the pipeline and the transports pack by them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from weightsync.core.native import copy_batch, copy_stream
from weightsync.core.wire.blocks import PackGroup
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.tensors import as_byte_view

__all__ = ["PackItem", "PlannedBucket", "pack_hashing", "pack_piece", "piece_bytes", "PIECE_BYTES"]

PIECE_BYTES = 256 * 1024
"""Bytes copied between two digest updates: small enough that the hash reads them back from the core's own cache.
A piece of at most this size is copied in a batch with its neighbours (``PlannedBucket.copies``), a larger one
streamed in pieces of this size (``PlannedBucket.large``)."""

PackItem = tuple[TensorMeta, torch.Tensor, int]
"""One piece of a bucket: ``(meta, source, start)``. ``source`` is the caller's tensor, or a contiguous copy of it
(its storage from ``data_ptr()`` holds the row-major bytes); ``start`` is the piece's byte offset in those bytes
(``meta.offset``). A plain tuple: the planner builds one per tensor, and a named tuple costs several times more."""


def piece_bytes(item: PackItem) -> torch.Tensor:
    """The piece as a flat uint8 tensor (for ``Tensor.copy_`` where raw addresses do not apply; not for a piece
    packed block after block: :func:`pack_piece`)."""
    meta, source, start = item
    return as_byte_view(source)[start:start + meta.nbytes]


def pack_piece(buffer: torch.Tensor, bucket: PlannedBucket, item: PackItem) -> None:
    """Copy one piece into its place in ``buffer`` (a bucket), without hashing."""
    meta, source, _ = item
    rows = bucket.rows.get(meta.bucket_offset) if meta.blocks else None
    if rows is not None:
        for triples, _ in rows:
            copy_batch(triples, buffer.data_ptr() + meta.bucket_offset, source.data_ptr())
    elif meta.nbytes:
        buffer[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece_bytes(item))


@dataclass(slots=True)
class PlannedBucket:
    items: list[PackItem] = field(default_factory=list)
    nbytes: int = 0
    """Bytes of the bucket's payload (the last piece's end, alignment padding included)."""
    payload_bytes: int = 0
    """Bytes of tensor data in it (padding excluded)."""
    completed: int = 0
    """Tensors whose last piece is in this bucket."""
    copies: list[int] = field(default_factory=list)
    """The host pieces of at most ``PIECE_BYTES``, flat ``(bucket offset, source address, nbytes)`` triples for one
    ``copy_batch`` (host addresses only: an accelerator tensor's address is never used as a host pointer)."""
    large: list[PackItem] = field(default_factory=list)
    """The other pieces (larger ones, and every piece of an accelerator tensor), in bucket order."""
    rows: dict[int, tuple[PackGroup, ...]] = field(default_factory=dict)
    """Pieces of a tensor packed block after block (``TensorMeta.blocks``), by bucket offset: their rows as
    ``copy_batch`` groups (:func:`weightsync.core.wire.blocks.block_packing`); such a piece is in ``large`` and its
    source on the host."""
    on_device: bool = False
    """Whether any piece's source lives on the accelerator (the bucket is staged before a host transport packs it,
    :mod:`weightsync.core.pipeline.bounce`)."""

    def __len__(self) -> int:
        return len(self.items)


def pack_hashing(base: int, bucket: PlannedBucket, digest: UpdateDigest) -> None:
    """Copy host sources into the host bucket at ``base``, hashing the bucket in order (padding included)."""
    copy_batch(bucket.copies, base, 0)  # every small piece in one call
    hashed = 0
    for meta, source, start in bucket.large:
        nbytes, at = meta.nbytes, meta.bucket_offset
        digest.update_at(base + hashed, at - hashed)  # the small pieces and padding before this one
        rows = bucket.rows.get(at) if meta.blocks else None
        if rows is not None:
            _pack_blocks(base + at, meta, source, rows, digest)
            hashed = at + nbytes
            continue
        address = source.data_ptr() + start
        for done in range(0, nbytes, PIECE_BYTES):
            size = min(PIECE_BYTES, nbytes - done)
            # Streamed into the bucket, so the bucket's copy is not in cache: the source's, just read, is, and holds
            # the same bytes (a receiver hashing the bucket checks this copy too).
            copy_stream(base + at + done, address + done, size)
            digest.update_at(address + done, size)
        hashed = at + nbytes
    digest.update_at(base + hashed, bucket.nbytes - hashed)


def _pack_blocks(address: int, meta: TensorMeta, source: torch.Tensor, rows: tuple[PackGroup, ...],
                 digest: UpdateDigest) -> None:
    """A piece packed block after block, to ``address``: each group (the same rows of every block, read from the
    tensor front to back) copied straight into the bucket and hashed there while in cache, each block's span into
    the sums of the parts that hold it (:meth:`UpdateDigest.begin_blocks`); a digest that reads the bucket in order
    reads the piece once it is packed."""
    by_blocks = digest.begin_blocks(meta)
    for triples, spans in rows:
        copy_batch(triples, address, source.data_ptr())
        if by_blocks:
            for block, start, nbytes in spans:
                digest.update_block(block, address + start, nbytes)
    if by_blocks:
        digest.end_blocks(meta, address)
    else:
        digest.update_at(address, meta.nbytes)
