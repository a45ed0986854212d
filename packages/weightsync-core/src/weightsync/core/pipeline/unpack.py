"""The receiver's last stage: from a received bucket to tensors — views for ``async for``, or copies into the
model's own memory (``copy_into``), hashing each piece right behind its copy while it is still in cache.

Three ways to copy a bucket, chosen per bucket by :meth:`BucketReader.copy_out`:

* **bulk** — a bucket of small pieces whose destinations all fit (:func:`destination_fits`): checked in one pass,
  then copied column-wise, one C call and one hash per ``PIECE_BYTES``;
* **batched** — per tensor: small pieces batched into one C call per ``PIECE_BYTES``, large ones streamed;
* **viewed** — the reference path: a typed view of the piece, ``Tensor.copy_`` into the destination. It takes any
  destination the others cannot fill (another device, non-contiguous, lazily negated or conjugated), device
  buckets, and every bucket when ``reference=True``.
"""

from __future__ import annotations

import array
from collections.abc import Mapping

import torch

from weightsync.api.errors import DestinationError
from weightsync.core.native import copy_batch, copy_columns, copy_stream
from weightsync.core.pipeline.gather import Gathers
from weightsync.core.transports.seam import Arrived
from weightsync.core.wire.blocks import block_copies
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.destinations import Fallback, check_destination, copy_regions, destination_fits, tensor_of
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.layout import PIECE_BYTES
from weightsync.core.wire.parts import PartLayout, PartSums
from weightsync.core.wire.tensors import COMPLEX_NAMES, DTYPES, dtype_from_name, memoryview_at

__all__ = ["BucketReader", "BulkPlans", "whole_only"]

class BulkPlan:
    """A bucket of small pieces of real dtypes (the many-small-tensors case) in columns, for the bulk copy."""

    __slots__ = ("names", "dtypes", "shapes", "sources", "sizes", "offsets", "chunks", "completed")

    def __init__(self, tensors: list[TensorMeta]) -> None:
        self.names = [meta.name for meta in tensors]
        self.dtypes = [DTYPES[meta.dtype] for meta in tensors]
        self.shapes = [meta.shape for meta in tensors]
        self.sources = array.array("Q", [meta.bucket_offset for meta in tensors])
        self.sizes = array.array("Q", [meta.nbytes for meta in tensors])
        self.offsets = [(index, meta.offset) for index, meta in enumerate(tensors) if meta.offset] or None
        self.completed = sum(meta.completes for meta in tensors)
        # Where to hash: as the batched copy does, every time PIECE_BYTES or more were copied since the last hash.
        self.chunks: list[tuple[int, int, int]] = []
        start = hashed = 0
        for index, meta in enumerate(tensors):
            end = meta.bucket_offset + meta.nbytes
            if end - hashed >= PIECE_BYTES or index == len(tensors) - 1:
                self.chunks.append((start, index + 1, end))
                start, hashed = index + 1, end

    @classmethod
    def of(cls, tensors: list[TensorMeta]) -> BulkPlan | None:
        if not tensors or any(meta.nbytes > PIECE_BYTES or meta.dtype in COMPLEX_NAMES or meta.blocks
                              for meta in tensors):
            return None
        return cls(tensors)


class BulkPlans:
    """Bulk plans of the bucket tables seen before, keyed by the table's bytes (a model's next update repeats them);
    bounded by their entries, cleared when full."""

    def __init__(self, limit: int = 1 << 18) -> None:
        self._plans: dict[bytes, BulkPlan | None] = {}
        self._entries = 0
        self._limit = limit

    def get(self, table: bytes, tensors: list[TensorMeta]) -> BulkPlan | None:
        try:
            return self._plans[table]
        except KeyError:
            pass
        plan = BulkPlan.of(tensors)
        if self._entries + len(tensors) > self._limit:
            self._plans.clear()
            self._entries = 0
        self._plans[table] = plan
        self._entries += len(tensors)
        return plan


def whole_only(destinations: Mapping[str, torch.Tensor], fallback: Fallback | None, layout: PartLayout
               ) -> tuple[dict[str, torch.Tensor], Fallback]:
    """``copy_into``'s destinations and fallback for a worker that holds ``layout``'s part, where whole tensors are
    written (a delta update): the destinations of a tensor's whole shape, and a fallback that takes the rest —
    nothing of a tensor the part does not hold, its box of one it holds into a shard, anything else to
    ``fallback``."""
    shapes = {name: layout.shard_shape(name) for name in destinations}
    whole = {name: destination for name, destination in destinations.items()
             if shapes[name] is None or tuple(destination.shape) != shapes[name]}

    def into_shards(name: str, tensor: torch.Tensor) -> object:
        if layout.plan.holds_none(name):
            return None
        boxes = layout.plan.tensors.get(name)
        shard = destinations.get(name)
        if boxes is not None and shard is not None and name not in whole:
            (start, size), = boxes
            with torch.no_grad():
                shard.copy_(tensor[tuple(slice(first, first + length) for first, length in zip(start, size))])
            return None
        if fallback is None:
            raise DestinationError(f"no destination for received tensor {name!r} (and no fallback)", name=name)
        return fallback(name, tensor)

    return whole, into_shards


class _Skipped(UpdateDigest):
    """The whole digest of a worker that verifies its part instead: folds nothing."""

    def begin_bucket(self, table: bytes, nbytes: int) -> None:
        pass

    def update_at(self, address: int, nbytes: int) -> None:
        pass


_SKIPPED = _Skipped()


class BucketReader:
    """Reads the current bucket of one update: where the consumer is in it, and how far it was hashed."""

    def __init__(self, digest: UpdateDigest, plans: BulkPlans, *, part: PartSums | None = None,
                 sources: bool = False, gather: Gathers | None = None) -> None:
        self.digest = digest
        self.plans = plans
        self.part = part
        """This worker's part, when it declared one (folded instead of the whole digest: :meth:`by_part`)."""
        self.sources = sources
        """Whether the update comes from several senders (a sharded ``actor_wg``): the digest and sums are routed by
        each bucket's sender, and a tensor's ranges may come from several of them in any order (``gather``)."""
        self.by_part = False
        self.folded = 0
        """Pieces of the current bucket already folded into the part's sums (by :meth:`copy_out`)."""
        self.current: Arrived | None = None
        self.position = 0
        self.hashed = 0
        self.tensors = 0
        """Tensors completed in this update."""
        self.gather = gather if gather is not None else Gathers()
        """Where a tensor that arrives in pieces is gathered for its view (the engine's buffers, kept across updates);
        the consumer's stream recycles them each time it asks for more."""
        self.gather.start()
        self.gathered = False
        """Whether the last view ``next_view`` gave was gathered from one sender's pieces: its stream's next split
        tensor would take another buffer while it is held, so a batch ends with it."""
        self.wrote = False
        """Whether a copy into the consumer's destinations (or a fallback call) has begun: set before the first."""

    def begin(self, arrived: Arrived) -> None:
        self.current, self.position, self.hashed, self.folded = arrived, 0, 0, 0
        if self.sources:
            self.digest.select(arrived.header.sender)
        if self.part is not None:
            self.part.route(arrived.header)
        if arrived.fused:
            self.digest.begin_bucket(arrived.table, arrived.header.nbytes)

    def fuse(self, fused: bool) -> bool:
        """Called by the receive thread before it hands over the update's first bucket, with whether the update's
        buckets are hashed behind the reader (a full update on the host); returns it. Then a worker that declared
        its part hashes that part of every bucket instead of every byte."""
        if fused and self.part is not None:
            self.digest, self.by_part = _SKIPPED, True
        return fused

    def finish(self) -> Arrived | None:
        """Hash what is left of the current bucket (or this worker's part of it); returns it (to release), or None."""
        current, self.current = self.current, None
        if current is not None and current.fused:
            self._hash_to(current, current.header.nbytes)
            if self.by_part and self.part is not None:
                self.part.fold_all(current.header.tensors[self.folded:], current.payload.data_ptr())
        return current

    @property
    def pending(self) -> bool:
        current = self.current
        return current is not None and self.position < len(current.header.tensors)

    def next_view(self) -> tuple[str, torch.Tensor] | None:
        """The next piece of the current bucket as a view; None when it is only part of a split tensor, or none of
        it is this worker's part (a stream that carries more: passed over, as ``copy_out`` passes it)."""
        current = self._current()
        meta = current.header.tensors[self.position]
        self.position += 1
        if current.fused and meta.bucket_offset - self.hashed >= PIECE_BYTES:
            # The consumer is done with every earlier piece: hash them while they are in cache.
            self._hash_to(current, meta.bucket_offset)
        if self.part is not None and self.part.plan.holds_none(meta.name):
            self.gathered = False
            self.tensors += meta.completes
            return None
        return self._tensor(meta, current.payload)

    def copy_out(self, destinations: Mapping[str, torch.Tensor], fallback: Fallback | None, *,
                 reference: bool = False) -> int:
        """Copy the current bucket's remaining pieces into ``destinations``; the number of tensors completed."""
        current = self._current()
        tensors = current.header.tensors
        if self.by_part and self.part is not None and not reference:
            return self._copy_part(current, self.part, destinations, fallback)
        if reference or not current.fused:  # a device payload: every tensor goes through its view
            count = 0
            while self.position < len(tensors):
                meta = tensors[self.position]
                self.position += 1
                count += self._copy_viewed(current, meta, destinations.get(meta.name), fallback)
            return count
        if self.position == 0:
            plan = self.plans.get(current.table, tensors)
            if plan is not None:
                completed = self._copy_bulk(plan, current.payload.data_ptr(), list(map(destinations.get, plan.names)))
                if completed is not None:
                    return completed
        return self._copy_batched(current, destinations, fallback)

    def skip_applied(self) -> int:
        """The rest of the current bucket was written elsewhere (a delta applied in place): the tensors it
        completes."""
        current = self._current()
        rest = current.header.tensors[self.position:]
        completed = sum(meta.completes for meta in rest)
        self.position = len(current.header.tensors)
        self.tensors += completed
        return completed

    def _current(self) -> Arrived:
        if self.current is None:
            raise RuntimeError("no bucket is current (callers check ``pending`` first)")
        return self.current

    def _copy_batched(self, current: Arrived, destinations: Mapping[str, torch.Tensor],
                      fallback: Fallback | None) -> int:
        """Per tensor, for the common destination (one that fits): small pieces batched into one ``copy_batch``
        call every ``PIECE_BYTES`` bytes and then hashed, large ones streamed. Copies land in stream order (a batch
        is flushed before any other copy), should two names share a destination."""
        tensors, base, get = current.header.tensors, current.payload.data_ptr(), destinations.get
        hashed, position = self.hashed, self.position
        batch: list[int] = []  # (destination address, bucket offset, nbytes) triples not copied yet
        count = copied = 0  # tensors completed; those of them completed here (``_copy_viewed`` counts its own)
        while position < len(tensors):
            meta = tensors[position]
            position += 1
            destination = get(meta.name)
            if meta.blocks or not destination_fits(destination, DTYPES[meta.dtype], meta.shape):
                if batch:
                    self._flush(batch, base)
                self.position, self.hashed = position, hashed
                count += self._copy_viewed(current, meta, destination, fallback)
                hashed = self.hashed
                continue
            address, nbytes, at = destination.data_ptr() + meta.offset, meta.nbytes, meta.bucket_offset
            if nbytes <= PIECE_BYTES:  # most tensors: batched, the hash catches up every PIECE_BYTES bytes
                batch += (address, at, nbytes)
                if at + nbytes - hashed >= PIECE_BYTES:
                    self._flush(batch, base)
                    self.digest.update_at(base + hashed, at + nbytes - hashed)
                    hashed = at + nbytes
            else:
                if batch:
                    self._flush(batch, base)
                self.wrote = True
                for done in range(0, nbytes, PIECE_BYTES):  # streamed: the model's memory is not read back here
                    copy_stream(address + done, base + at + done, min(PIECE_BYTES, nbytes - done))
                    end = at + min(done + PIECE_BYTES, nbytes)
                    self.digest.update_at(base + hashed, end - hashed)
                    hashed = end
            copied += meta.completes
        if batch:
            self._flush(batch, base)
        self.position, self.hashed = position, hashed  # (after an error the stream is closed: no write-back)
        self.tensors += copied
        return count + copied

    def _flush(self, batch: list[int], base: int) -> None:
        """Copy the pieces ``_copy_batched`` batched (destination address, bucket offset, bytes), and empty it."""
        self.wrote = True
        copy_batch(batch, 0, base, stream=True)
        batch.clear()

    def _copy_bulk(self, plan: BulkPlan, base: int, found: list[torch.Tensor | None]) -> int | None:
        """A whole bucket of small pieces: the tensors completed, or None when any destination does not fit (then
        nothing was copied and the batched copy takes the bucket)."""
        if not all(map(destination_fits, found, plan.dtypes, plan.shapes)):
            return None
        addresses = array.array("Q", [destination.data_ptr() for destination in found])  # type: ignore[union-attr]
        if plan.offsets is not None:  # the tail of a tensor split across buckets lands at its offset
            for index, offset in plan.offsets:
                addresses[index] += offset
        hashed = 0
        self.wrote = True
        for start, stop, end in plan.chunks:
            copy_columns(addresses, plan.sources, plan.sizes, start, stop, base)
            self.digest.update_at(base + hashed, end - hashed)
            hashed = end
        self.position, self.hashed = len(found), hashed
        self.tensors += plan.completed
        return plan.completed

    def _copy_part(self, current: Arrived, part: PartSums, destinations: Mapping[str, torch.Tensor],
                   fallback: Fallback | None) -> int:
        """This worker's part of the current bucket, and nothing else: a tensor the part does not hold is passed
        over (it needs no destination); one it holds whole is copied whole; of one it holds a box of, only the box's
        bytes — where they lie in a destination of the tensor's shape, or packed in row-major order into a
        **shard** (a destination of the box's shape). Each group of copies is hashed into the part's sums right
        behind it, while in cache. Any other destination, or the fallback, takes the piece through its view."""
        tensors, base, layout = current.header.tensors, current.payload.data_ptr(), part.layout
        count = 0
        while self.position < len(tensors):
            meta = tensors[self.position]
            self.position += 1
            address, runs = base + meta.bucket_offset, layout.runs_of(meta)
            destination, dtype = destinations.get(meta.name), DTYPES[meta.dtype]
            shard = layout.shard_shape(meta.name)
            completed = meta.completes
            if runs is not None and not runs[0]:  # none of this tensor is the part's
                pass
            elif destination_fits(destination, dtype, meta.shape) or (
                    shard is not None and destination_fits(destination, dtype, shard)):
                self.wrote = True
                self._copy_selected(meta, address, destination, part, runs)
            else:
                count += self._copy_viewed(current, meta, destination, fallback)  # (counts what it completes)
                part.fold(meta, address)
                completed = False
            self.folded = self.position
            self.tensors += completed
            count += completed
        return count

    @staticmethod
    def _copy_selected(meta: TensorMeta, address: int, destination: torch.Tensor, part: PartSums,
                       runs: tuple[list[int], list[int]] | None) -> None:
        """Copy a piece's selected bytes into ``destination`` (of the tensor's shape, or a shard) and fold them: a
        whole tensor's and a shard's group by group, each hashed behind its copy (in the shard, where the group is
        contiguous); a box's in a full-shape destination after its copies, from the bucket."""
        target = destination.data_ptr()
        compact = tuple(destination.shape) != meta.shape
        if runs is not None and not compact and meta.blocks:  # its block's rows, each where it belongs
            low, high = max(runs[0][0], meta.offset), min(runs[1][0], meta.offset + meta.nbytes)
            for triples, _, _ in block_copies(tuple(meta.shape), DTYPES[meta.dtype].itemsize, meta.blocks, low, high):
                copy_batch(triples, target, address + low - meta.offset)
            part.fold(meta, address)
            return
        if runs is not None and not compact:
            for group in part.layout.copies(meta, runs, compact=False):
                copy_batch(group.triples, target, address)
            part.fold(meta, address)
            return
        hashing = part.open(meta)
        if runs is None:  # held whole
            for done in range(0, meta.nbytes, PIECE_BYTES):
                nbytes = min(PIECE_BYTES, meta.nbytes - done)
                copy_stream(target + meta.offset + done, address + done, nbytes)
                hashing.update(memoryview_at(address + done, nbytes))
            part.nbytes += meta.nbytes
        else:
            for group in part.layout.copies(meta, runs, compact=True):
                if len(group.triples) == 3:  # a long run's piece: streamed, hashed from the source just read
                    copy_stream(target + group.start, address + group.triples[1], group.nbytes)
                    hashing.update(memoryview_at(address + group.triples[1], group.nbytes))
                else:  # short runs: copied through the cache, hashed where they now lie together
                    copy_batch(group.triples, target, address)
                    hashing.update(memoryview_at(target + group.start, group.nbytes))
                part.nbytes += group.nbytes
        part.close(meta)

    def _copy_viewed(self, current: Arrived, meta: TensorMeta, destination: torch.Tensor | None,
                     fallback: Fallback | None) -> int:
        """One piece through its view: into a destination with ``copy_``, or to the fallback."""
        if destination is None and fallback is None:
            raise DestinationError(f"no destination for received tensor {meta.name!r} (and no fallback)",
                                   name=meta.name)
        if destination is not None:
            check_destination(meta, destination)
        if current.fused and meta.bucket_offset - self.hashed >= PIECE_BYTES:
            self._hash_to(current, meta.bucket_offset)
        ready = self._tensor(meta, current.payload)
        if ready is None:
            return 0
        self.wrote = True
        if destination is not None:
            copy_regions(destination, ready[1], self.part.plan.tensors.get(meta.name) if self.part is not None else None)
        elif fallback is not None:
            fallback(*ready)
        self.gather.recycle()  # (the view handed over is no longer valid)
        return 1

    def _hash_to(self, current: Arrived, end: int) -> None:
        """Hash the current bucket's bytes up to ``end`` (or fold this worker's part of the pieces that end there)."""
        if end > self.hashed:
            self.digest.update_at(current.payload.data_ptr() + self.hashed, end - self.hashed)
            self.hashed = end
            if self.by_part and self.part is not None:
                tensors, stop = current.header.tensors, self.folded
                while stop < len(tensors) and tensors[stop].bucket_offset + tensors[stop].nbytes <= end:
                    stop += 1
                self.part.fold_all(tensors[self.folded:stop], current.payload.data_ptr())
                self.folded = stop

    def _tensor(self, meta: TensorMeta, payload: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        dtype = dtype_from_name(meta.dtype)
        piece = payload[meta.bucket_offset: meta.bucket_offset + meta.nbytes]
        if meta.is_whole:
            self.gathered = False
            self.tensors += 1
            return meta.name, self._shaped(meta, piece, dtype)
        self.gathered = not self.sources
        gathered = self.gather.put(meta, piece, self.part.layout if self.part is not None else None)
        if gathered is None:
            return None
        self.tensors += 1
        return meta.name, self._shaped(meta, gathered, dtype)

    def _shaped(self, meta: TensorMeta, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A whole tensor's bytes as the tensor; one packed block after block as a full-shape view whose elements
        inside this worker's block are that block (``weightsync.core.wire.blocks.block_view``)."""
        return tensor_of(data, meta, dtype, self.part.layout.block_of(meta) if self.part is not None else None)
