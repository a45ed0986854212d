"""A receiver's side of delta updates: the version it holds, refusing changes against any other, applying each
delta bucket in place, and verifying what it holds afterwards (the format: :mod:`weightsync.core.delta.encoding`)."""

from __future__ import annotations

import array
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from weightsync.api.errors import DestinationError, DigestMismatchError, TransferError
from weightsync.core import native
from weightsync.core.delta.copies import BaseCopies, PlacedCopies
from weightsync.core.delta.encoding import Held, ModelDigest, applied_sum, apply, held_sum, piece_key, unit_of
from weightsync.core.delta.parts import PartWords
from weightsync.core.transports.seam import Arrived, ReceiverTransport
from weightsync.core.wire import codec, tensors
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.destinations import Fallback, check_destination, copy_regions, destination_fits, tensor_of
from weightsync.core.wire.parts import PartLayout
from weightsync.core.wire.tensors import DTYPES

__all__ = ["ReceiverDelta"]


class ReceiverDelta:
    """A receiver's side of delta updates, across updates: the version it holds (and its model digest), what it
    keeps for a consumer that iterates views, and, during an update, where every received piece now lives.

    A delta bucket is applied in place: into the kept copy when the receiver keeps one (its consumer iterated views
    last time; the bucket is then read from the copy as a dense one), else straight into the ``copy_into``
    destinations. A tensor with no destination there goes to the consumer's fallback as in a full update: the
    receiver keeps a host copy of each such tensor (``placed``), brings it up to the new version and hands the
    fallback the whole tensor. A receiver that does not hold the update's base refuses it before writing anything.
    """

    def __init__(self, *, verify_every: int, placed: PlacedCopies | None = None) -> None:
        self.verify_every = verify_every
        self.held: tuple[int, str] | None = None
        """(version, model digest) of what this receiver holds; None while an update is under way or after one
        failed."""
        self.kept = BaseCopies()
        self._owns_placed = placed is None
        self.placed = PlacedCopies() if placed is None else placed
        """Host copies of the tensors a ``copy_into`` consumer's fallback takes (another's, shared: begun and
        completed by its owner)."""
        self.delta_updates = 0
        self._base: tuple[int, str] | None = None
        self._kept_base: int | None = None
        self._model: ModelDigest | None = None
        """This update's model digest, folded bucket by bucket as each is final here; None when this update is not
        verified (a full update, not due, or a bucket this receiver cannot sum)."""
        self.wrote = False
        """Whether this update began writing changes into the consumer's destinations."""
        self._views = True
        self.part: PartWords | None = None
        """This worker's part, which its kept copy holds alone (``weightsync.core.delta.parts``); None: it keeps
        the whole model."""
        self.layout: PartLayout | None = None
        """This worker's part, where it declared one: a tensor packed block after block that a host copy holds is
        handed over as the view of its block (kept alone or not: from several senders it is not)."""
        self._words: dict[tuple[bytes, int], PartWords] = {}

    def held_weights(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]] | None:
        """The version this receiver holds and keeps a whole copy of (its consumer iterated views), with that copy's
        tensors (``BaseCopies.weights``); None when it keeps none (or its part alone)."""
        if self.held is None or self.kept.version != self.held[0] or not self.kept.buckets or self.kept.partial:
            return None
        return self.kept.version, self.kept.weights()

    def begin(self, part: PartLayout | None = None, *, alone: bool = True) -> None:
        """A new update starts: until it completes, this receiver holds no version it can vouch for. ``part``: this
        worker's, when it declared one: with ``alone``, a copy kept for its views then holds that part alone."""
        self.layout = part
        self.part = None if part is None or not alone else PartWords.of(part, self._words)
        self.kept.hold(self.part is not None)
        self.wrote = False
        self._base, self.held = self.held, None
        self._kept_base, self.kept.version = self.kept.version, None
        if self._owns_placed:
            self.placed.begin()
        self._model = None
        self._views = True

    def _verifies(self, header: codec.BucketHeader) -> bool:
        """Whether this update's model digest is being folded (decided at its first bucket: delta updates, every
        ``verify_every``-th of them)."""
        if header.index == 0:
            due = header.base >= 0 and (self.delta_updates + 1) % self.verify_every == 0
            self._model = ModelDigest() if due else None
        return self._model is not None

    def _fold(self, header: codec.BucketHeader, table: bytes, pieces: Sequence[Held],
              in_shards: Sequence[tuple[TensorMeta, int]] = ()) -> None:
        """Fold what this receiver holds of a bucket: ``pieces``, and ``in_shards`` (``(meta, address)``: pieces
        whose held ranges lie in a shard, byte 0 of the piece as the shard's bytes see it)."""
        if self._verifies(header) and self._model is not None:
            ranges = self.part.ranges if self.part is not None else None
            total = held_sum(header.index, pieces, ranges)
            if in_shards and self.part is not None:
                total = (total + applied_sum(_rows(header.index, in_shards), self.part.segments(
                    [meta for meta, _ in in_shards]))) & _MASK
            self._model.add(table, _layout(header), total)

    def _in_shard(self, meta: TensorMeta, shards: Mapping[str, torch.Tensor] | None) -> int | None:
        """Where a piece's byte 0 lies as its shard's bytes see it, when its changes can go straight into the
        worker's shard of the tensor (a destination of its one box's shape): the part's bytes of the tensor are one
        run (rows of it, or its block of one packed block after block) laid out in the shard as they travel, and the
        piece's held ranges stay inside that run. None where they cannot: the tensor is then kept whole here."""
        if shards is None or self.part is None:
            return None
        layout = self.part.layout
        shape, shard = layout.shard_shape(meta.name), shards.get(meta.name)
        if shape is None or shape == meta.shape or not destination_fits(shard, DTYPES[meta.dtype], shape):
            return None
        runs = layout.runs_of(meta)
        if runs is None or len(runs[0]) != 1:
            return None
        start, end = runs[0][0], runs[1][0]
        if any(meta.offset + low < start or meta.offset + high > end for low, high in self.part.ranges(meta)):
            return None  # a held range rounded out to words past the run (its ends are not on words)
        address = shard.data_ptr() + meta.offset - start
        return address if address >= 0 else None

    def check_base(self, header: codec.BucketHeader, peer: str) -> None:
        """Refuse a delta update against a base this receiver does not hold (before anything is written)."""
        if header.base >= 0 and self._base != (header.base, header.base_model):
            held = f"version {self._base[0]}" if self._base is not None else "no version it can vouch for"
            raise TransferError(f"{peer} sent changes against version {header.base}, but this receiver holds {held}: "
                                "it needs a full update", peer=peer)

    def take(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None,
             fallback: Fallback | None = None, *, transport: ReceiverTransport | None = None,
             shards: Mapping[str, torch.Tensor] | None = None) -> bool:
        """A bucket of a delta update, before the consumer reads it. True: the consumer reads it as a dense bucket
        (a delta applied to the kept copy is read from there); False: it went straight into ``destinations`` and
        is done (a tensor with no destination handed to ``fallback`` whole). Every bucket of the update goes one
        way: a tensor split across buckets may arrive partly dense, partly as changes, and each piece must land in
        place. With ``transport`` (the one it arrived on), a small encoding is released first (``_leave_buffer``).
        ``shards``: a worker of a part's own destinations, whose shards take its changes in place where they can
        (:meth:`_in_shard`)."""
        if transport is not None:
            _leave_buffer(arrived, transport)
        header, payload = arrived.header, arrived.payload[: arrived.header.nbytes]
        kept_valid = self._kept_base is not None and self._kept_base == header.base
        if header.dense < 0 and (destinations is None or kept_valid):
            return True
        if not payload.is_cpu:
            payload = payload.cpu()
        kept = self.kept.match(header.index, arrived.table, header.dense) if kept_valid else None
        if kept is not None:
            at = kept.data.data_ptr()
            apply(payload, _rows(header.index, [(meta, at + meta.bucket_offset) for meta in header.tensors]),
                  held=self.part.segments(header.tensors) if self.part is not None else None)
            arrived.payload = kept.data  # read from the kept copy as a dense bucket (``read`` folds it)
            return True
        if destinations is None:
            raise TransferError("a delta update reached a consumer that iterates views, and this receiver kept no "
                                "copy of the previous version to rebuild whole tensors from: it needs a full update",
                                peer="this receiver")
        self._views = False
        places = _Places(header, self.part)
        for meta in header.tensors:
            destination, in_shard = destinations.get(meta.name), self._in_shard(meta, shards)
            if in_shard is not None:
                places.into_shard(meta, in_shard)
            elif destination is not None and not meta.blocks:
                places.into(meta, destination)
            elif destination is None and fallback is None:
                raise DestinationError(f"no destination for received tensor {meta.name!r} (and no fallback)",
                                       name=meta.name)
            else:  # one only the fallback takes, or one packed block after block: a host copy in the bucket's order
                places.kept(meta, self.placed.get(meta, fresh=header.dense < 0, untouched=self.part is not None))
        # Verified here, from the bytes just written (a piece changed in a host copy is summed there: the copy goes
        # back unchanged), unless a whole tensor was copied: then from what the destinations hold, below.
        verified = not places.whole and self._verifies(header)
        self.wrote = True
        total = places.write(payload, summed=verified)
        if verified and self._model is not None:
            self._model.add(arrived.table, _layout(header), total)
        elif places.whole:
            self._fold(header, arrived.table, places.held, places.in_shards)
        places.hand_over(self.placed, destinations, fallback, self.layout)
        return False

    def read(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None, *,
             shards: Mapping[str, torch.Tensor] | None = None) -> None:
        """A bucket was read as a dense one: by views (its bytes are kept, for the next delta) or into
        ``destinations`` and ``shards`` (recorded, for verifying what this receiver holds)."""
        header = arrived.header
        if destinations is None:
            kept = self.kept.replace(header.index, arrived.table, _layout(header))
            part = self.part
            if arrived.payload.data_ptr() != kept.data.data_ptr():  # not read from the kept copy: keep it now
                if part is not None:  # its held ranges alone (the copy's other pages stay unwritten)
                    native.copy_batch(part.copies(header.tensors), kept.data.data_ptr(), arrived.payload.data_ptr())
                for meta in header.tensors if part is None else ():
                    piece = arrived.payload[meta.bucket_offset:meta.bucket_offset + meta.nbytes]
                    kept.data[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece)
            self._fold(header, arrived.table, [(meta, kept.data, meta.bucket_offset) for meta in header.tensors])
            return
        self._views = False
        held: list[Held] = []
        in_shards: list[tuple[TensorMeta, int]] = []
        for meta in header.tensors:
            destination, in_shard = destinations.get(meta.name), self._in_shard(meta, shards)
            if in_shard is not None:  # the reader copied the part into its shard, where the next changes go
                in_shards.append((meta, in_shard))
                continue
            if destination is None or meta.blocks:  # the fallback took it, or it came block after block: kept
                # for the next delta update in the bucket's order (a worker's part: its held ranges alone)
                destination = self.placed.get(meta, fresh=True, untouched=self.part is not None)
                ranges = self.part.ranges(meta) if self.part is not None else ((0, meta.nbytes),)
                native.copy_batch([value for low, high in ranges for value in (meta.offset + low, low, high - low)],
                                  destination.data_ptr(), arrived.payload.data_ptr() + meta.bucket_offset)
            held.append((meta, destination, meta.offset))
        self._fold(header, arrived.table, held, in_shards)

    def complete(self, header: codec.BucketHeader, *, receiver: int, peer: str) -> None:
        """The update's final header: verify what this receiver holds when due, then hold the new version."""
        if not header.model:
            return
        if header.base >= 0:
            self.delta_updates += 1
            if self._model is not None:
                actual, expected, what = self._model.hexdigest(), header.model, "tensors"
                if self.part is not None:
                    index = self.part.index
                    expected = header.part_models[index] if index < len(header.part_models) else ""
                    what = f"its part {index} of tensors"
                if actual != expected:
                    raise DigestMismatchError(
                        f"rollout rank {receiver} holds {what} whose digest {actual[:16]} differs from version "
                        f"{header.version}'s {expected[:16] or '(none sent)'} from {peer} after applying its "
                        "changes: a destination changed outside the engine, or the base was not what it claimed",
                        receiver=receiver, expected=expected, actual=actual)
        self.held = (header.version, header.model)
        if self._owns_placed:
            self.placed.complete()
        if self._views:
            self.kept.version, self.kept.model = header.version, header.model
            self.kept.truncate(header.index)


def _leave_buffer(arrived: Arrived, transport: ReceiverTransport) -> None:
    """An encoding of at most a quarter of a receive buffer is copied out of it and the buffer released before the
    changes are applied: the buffer goes back to the sender at once, which keeps one more bucket in flight while
    they are written (a delta update is short of buckets in flight, not of bytes)."""
    nbytes = arrived.header.nbytes
    if arrived.header.dense >= 0 and arrived.token > 0 and arrived.payload.is_cpu and (
            nbytes <= transport.capacity // 4):
        arrived.payload = arrived.payload[:nbytes].clone()
        transport.release(arrived.token)
        arrived.token = 0


_MASK = (1 << 64) - 1


def _row(index: int, meta: TensorMeta, address: int) -> tuple[int, int, int, int]:
    """``apply``'s row for a piece of bucket ``index`` at ``address``."""
    return address, meta.nbytes, unit_of(meta), piece_key(index, meta.bucket_offset)


def _rows(index: int, pieces: Iterable[tuple[TensorMeta, int]]) -> array.array[int]:
    """``apply``'s rows for pieces of bucket ``index`` at the addresses given."""
    return array.array("Q", [value for meta, address in pieces for value in _row(index, meta, address)])


def _layout(header: codec.BucketHeader) -> int:
    """The size of the dense bucket a header's table describes."""
    return header.dense if header.dense >= 0 else header.nbytes


class _Places:
    """Where each piece of one delta bucket is written, for a ``copy_into`` consumer: straight into a destination
    that raw writes can fill; a host copy of the piece's bytes for a destination on another device, or of the whole
    tensor for one in a layout raw writes cannot fill (changed, then copied back); the receiver's own host copy of
    a tensor only the consumer's fallback takes."""

    def __init__(self, header: codec.BucketHeader, part: PartWords | None) -> None:
        self.header = header
        self.part = part
        """The worker's part: each piece written and summed in its held ranges alone."""
        self.rows = array.array("Q")
        """``apply``'s rows, in the bucket's order."""
        self.held: list[Held] = []
        self.windows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.placed: list[tuple[TensorMeta, torch.Tensor]] = []
        self.in_shards: list[tuple[TensorMeta, int]] = []

    def _row(self, meta: TensorMeta, address: int) -> None:
        self.rows.extend(_row(self.header.index, meta, address))

    def into(self, meta: TensorMeta, destination: torch.Tensor) -> None:
        check_destination(meta, destination)
        dtype = DTYPES[meta.dtype]
        if destination_fits(destination, dtype, meta.shape):
            address = destination.data_ptr() + meta.offset
        elif destination_fits(destination, dtype, meta.shape, anywhere=True):
            window = tensors.as_byte_view(destination)[meta.offset:meta.offset + meta.nbytes]
            # A dense bucket overwrites the piece (unless a part's held ranges alone): nothing to read back first.
            host = (window.cpu() if self.header.dense >= 0 or self.part is not None
                    else torch.empty(meta.nbytes, dtype=torch.uint8))
            self.windows.append((window, host))
            address = host.data_ptr()
        else:
            if meta.name not in self.whole:
                self.whole[meta.name] = (destination, tensors.as_byte_view(destination).cpu().clone())
            address = self.whole[meta.name][1].data_ptr() + meta.offset
        self._row(meta, address)
        self.held.append((meta, destination, meta.offset))

    def into_shard(self, meta: TensorMeta, address: int) -> None:
        """A piece whose held ranges lie in the worker's shard (``ReceiverDelta._in_shard``: ``address`` is the
        piece's byte 0 as the shard's bytes see it; only the held ranges are ever written or read there)."""
        self._row(meta, address)
        self.in_shards.append((meta, address))

    def kept(self, meta: TensorMeta, copy: torch.Tensor) -> None:
        self._row(meta, copy.data_ptr() + meta.offset)
        self.held.append((meta, copy, meta.offset))
        self.placed.append((meta, copy))

    def write(self, payload: torch.Tensor, *, summed: bool) -> int:
        """Write the bucket (changes, or dense bytes) to every place, then copy the host copies back; with
        ``summed``, the keyed sum of what was written (else 0)."""
        total, part, metas = 0, self.part, self.header.tensors
        held = part.segments(metas) if part is not None else None
        if self.header.dense >= 0:  # with ``summed``, each stretch summed right after its changes, in one pass
            total = apply(payload, self.rows, summed=summed, held=held)
        else:  # a bucket sent dense: each piece (its held ranges) copied to its place
            at, rows = payload.data_ptr(), self.rows
            native.copy_batch([value for row, meta in enumerate(metas)
                               for low, high in (part.ranges(meta) if part is not None else ((0, meta.nbytes),))
                               for value in (rows[4 * row] + low, at + meta.bucket_offset + low, high - low)], 0, 0)
            if summed:
                total = applied_sum(rows, held)
        with torch.no_grad():
            for window, host in self.windows:
                window.copy_(host)
            for destination, host in self.whole.values():
                destination.copy_(host.view(destination.dtype).reshape(destination.shape))
        return total

    def hand_over(self, copies: PlacedCopies, destinations: Mapping[str, torch.Tensor], fallback: Fallback | None,
                  part: PartLayout | None) -> None:
        """Each tensor kept in a host copy that this bucket completed, whole now: to the fallback; one packed block
        after block as a full-shape view whose elements in this worker's block are the block (``part``'s), into its
        destination's block when it has one."""
        for meta, copy in self.placed:
            if not copies.written(meta):
                continue
            index = part.block_of(meta) if part is not None and meta.blocks else None
            tensor = tensor_of(copy, meta, DTYPES[meta.dtype], index)
            destination = destinations.get(meta.name)
            if destination is not None and index is not None and part is not None:
                copy_regions(destination, tensor, part.plan.tensors.get(meta.name))
            elif fallback is not None:
                fallback(meta.name, tensor)
