"""Delta updates: a bucket travels as the units that changed since the base version, applied in place on arrival.

Between two RL steps most low-precision weights keep their exact bits, so an update can carry only what changed.
The sender keeps a host copy of the base version, bucket by bucket in the bucket's own layout (:class:`BaseCopies`;
padding zero), and compares each new bucket's pieces with it in one compiled pass (``_stream_copy.c``), which also
brings the copy up to the new version. A bucket whose encoding is not smaller than its dense bytes goes dense.

The encoding of one bucket, piece after piece in its table's order: runs of changed units (a unit is the dtype's
element size, at most 8 bytes), each ``varint run, varint gap, run × unit new bytes`` (the gap counted from the end
of the previous run, or from the piece's start), the piece closed by a 0 byte. Receivers check an encoding whole
before writing a byte of it (:func:`apply`): a malformed one is a ``WireError`` and changes nothing.

Exact or nothing: every delta bucket names its base version and the base's *model digest* — the digest of what a
receiver holds (every bucket's table and its tensors' bytes, padding zero), not of what crossed the wire — and a
receiver that does not hold exactly that base refuses it before writing. After applying, receivers hash what they
hold and compare it with the new version's model digest (:func:`fold_bucket`), so a destination changed behind the
engine's back is found at the next delta update.
"""

from __future__ import annotations

import array
import ctypes
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from weightsync.api.errors import DestinationError, DigestMismatchError, TransferError, WireError
from weightsync.core import codec, tensors
from weightsync.core.codec import TensorMeta
from weightsync.core.digest import UpdateDigest
from weightsync.core.tensors import DTYPES, memoryview_of
from weightsync.core.unpack import Arrived, check_destination, destination_fits

__all__ = ["BaseCopies", "BucketCopy", "ENCODER", "ReceiverDelta", "apply", "encode", "fold_bucket", "unit_of"]

_UNITS = {name: min(dtype.itemsize, 8) for name, dtype in DTYPES.items()}


def _encoder() -> str:
    if tensors._HELPER is None:
        return f"unavailable ({tensors._HELPER_MISSING}): delta updates send every bucket dense"
    return "compiled"


ENCODER = _encoder()
"""How buckets are compared and encoded (``weightsync doctor`` shows it): the compiled helper, or why not."""


def unit_of(meta: TensorMeta) -> int:
    """The unit a piece is compared in: its element size (at most 8 bytes), or a byte for a ragged piece."""
    unit = _UNITS[meta.dtype]
    return unit if meta.nbytes % unit == 0 else 1


def encode(rows: array.array[int], out: int, capacity: int) -> tuple[int | None, int]:
    """Encode the pieces ``rows`` (flat ``(source address, base address, nbytes, unit)`` rows) into host memory at
    ``out``, and bring each base up to its source. Returns the encoding's length (None when it would not fit in
    ``capacity`` bytes) and the changed bytes. Needs the compiled helper (``ENCODER``)."""
    helper = tensors._HELPER
    if helper is None:
        raise RuntimeError("delta encoding needs the compiled _stream_copy helper")
    changed = ctypes.c_uint64(0)
    length = helper.weightsync_delta_encode(rows.buffer_info()[0], len(rows) // 4, out, capacity,
                                            ctypes.byref(changed))
    return (None if length == (1 << 64) - 1 else int(length)), int(changed.value)


_MALFORMED = "malformed delta bucket: a run outside its tensor, or bytes missing or left over"


def apply(encoded: torch.Tensor, rows: array.array[int], each: Callable[[int], None] | None = None) -> None:
    """Apply the encoding ``encoded`` (a host uint8 tensor) to the pieces ``rows`` (flat ``(destination address,
    nbytes, unit)`` rows, in the encoding's order); ``WireError``, with nothing written, when it is malformed.
    ``each(i)`` runs once piece i is written (a receiver hashes it there, while its bytes are still in cache)."""
    helper = tensors._HELPER
    count = len(rows) // 3
    if helper is None:
        data = bytes(memoryview_of(encoded)) if encoded.numel() else b""
        _walk(data, rows, write=False)
        _walk(data, rows, write=True)
        if each is not None:
            for piece in range(count):
                each(piece)
        return
    address, table = encoded.data_ptr(), rows.buffer_info()[0]
    if each is None:
        if helper.weightsync_delta_apply(address, encoded.numel(), table, count) != 0:
            raise WireError(_MALFORMED)
        return
    ends = array.array("Q", bytes(8 * count))
    if helper.weightsync_delta_check(address, encoded.numel(), table, count, ends.buffer_info()[0]) != 0:
        raise WireError(_MALFORMED)
    start = 0
    for piece, end in enumerate(ends):  # checked whole: each part applies on its own
        helper.weightsync_delta_apply(address + start, end - start, table + 24 * piece, 1)
        each(piece)
        start = end


def _walk(data: bytes, rows: array.array[int], *, write: bool) -> None:
    """The helper's apply in Python (a receiver built without it): check, or write."""
    position = 0

    def varint() -> int:
        nonlocal position
        value = shift = 0
        while shift < 64:
            if position >= len(data):
                raise WireError("malformed delta bucket: it ends inside a run")
            byte = data[position]
            position += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7
        raise WireError("malformed delta bucket: a varint longer than 64 bits")

    for row in range(0, len(rows), 3):
        address, nbytes, unit = rows[row], rows[row + 1], rows[row + 2]
        units, at = nbytes // unit, 0
        while (run := varint()) != 0:
            gap = varint()
            if gap > units - at or run > units - at - gap or len(data) - position < run * unit:
                raise WireError("malformed delta bucket: a run outside its tensor")
            at += gap
            if write:
                ctypes.memmove(address + at * unit, data[position:position + run * unit], run * unit)
            position += run * unit
            at += run
    if position != len(data):
        raise WireError("malformed delta bucket: bytes left over after its last tensor")


@dataclass(slots=True)
class BucketCopy:
    """One bucket of a kept version: its table and its bytes in the bucket's layout (padding zero)."""

    table: bytes
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass
class BaseCopies:
    """A version kept on the host, bucket by bucket: the sender's base, or a receiver's copy for a consumer that
    iterates views (it gets whole tensors from a delta only through this copy). ``version`` is None while the copy
    is being changed or after an update that did not complete: it then holds no version anyone can rely on."""

    version: int | None = None
    model: str = ""
    """The model digest of ``version``."""
    buckets: list[BucketCopy] = field(default_factory=list)

    def match(self, index: int, table: bytes, nbytes: int) -> BucketCopy | None:
        """The kept bucket ``index`` when it has this table and size (so its pieces line up), else None."""
        if index < len(self.buckets):
            kept = self.buckets[index]
            if kept.table == table and kept.nbytes == nbytes:
                return kept
        return None

    def replace(self, index: int, table: bytes, nbytes: int) -> BucketCopy:
        """A fresh zeroed copy for bucket ``index`` (the layout changed, or the copy is new)."""
        kept = self.match(index, table, nbytes)
        if kept is None:
            kept = BucketCopy(table, torch.zeros(nbytes, dtype=torch.uint8))
            if index < len(self.buckets):
                self.buckets[index] = kept
            else:
                self.buckets.append(kept)
        return kept

    def truncate(self, count: int) -> None:
        """Drop the buckets past ``count`` (the model got smaller)."""
        del self.buckets[count:]

    @property
    def nbytes(self) -> int:
        return sum(kept.nbytes for kept in self.buckets)


Held = tuple[TensorMeta, torch.Tensor, int]
"""Where one piece of the received version lives: ``(meta, tensor, start)``, its bytes ``start:+meta.nbytes`` of
the tensor's bytes (a destination and the piece's offset in it, or a kept bucket and the piece's bucket offset)."""


class ReceiverDelta:
    """A receiver's side of delta updates, across updates: the version it holds (and its model digest), what it
    keeps for a consumer that iterates views, and, during an update, where every received piece now lives.

    A delta bucket is applied in place: into the kept copy when the receiver keeps one (its consumer iterated views
    last time; the bucket is then read from the copy as a dense one), else straight into the ``copy_into``
    destinations. A receiver that does not hold the update's base refuses it before writing anything.
    """

    def __init__(self, *, verify_every: int) -> None:
        self.verify_every = verify_every
        self.held: tuple[int, str] | None = None
        """(version, model digest) of what this receiver holds; None while an update is under way or after one
        failed."""
        self.kept = BaseCopies()
        self.delta_updates = 0
        self._base: tuple[int, str] | None = None
        self._kept_base: int | None = None
        self._model: UpdateDigest | None = None
        """This update's model digest, folded bucket by bucket as each is final here; None when this update is not
        verified (a full update, not due, or a bucket this receiver cannot hash)."""
        self._views = True

    def begin(self) -> None:
        """A new update starts: until it completes, this receiver holds no version it can vouch for."""
        self._base, self.held = self.held, None
        self._kept_base, self.kept.version = self.kept.version, None
        self._model = None
        self._views = True

    def _verifies(self, header: codec.BucketHeader) -> bool:
        """Whether this update's model digest is being folded (decided at its first bucket: delta updates, every
        ``verify_every``-th of them)."""
        if header.index == 0:
            due = header.base >= 0 and (self.delta_updates + 1) % self.verify_every == 0
            self._model = UpdateDigest() if due else None
        return self._model is not None

    def _fold(self, header: codec.BucketHeader, table: bytes, pieces: Sequence[Held]) -> None:
        if self._verifies(header) and self._model is not None:
            fold_bucket(self._model, table, _layout(header), pieces)

    def check_base(self, header: codec.BucketHeader, peer: str) -> None:
        """Refuse a delta update against a base this receiver does not hold (before anything is written)."""
        if header.base >= 0 and self._base != (header.base, header.base_model):
            held = f"version {self._base[0]}" if self._base is not None else "no version it can vouch for"
            raise TransferError(f"{peer} sent changes against version {header.base}, but this receiver holds {held}: "
                                "it needs a full update", peer=peer)

    def take(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None) -> bool:
        """A bucket of a delta update, before the consumer reads it. True: the consumer reads it as a dense bucket
        (a delta applied to the kept copy is read from there); False: it went straight into ``destinations`` and
        is done. Every bucket of the update goes one way: a tensor split across buckets may arrive partly dense,
        partly as changes, and each piece must land in place."""
        header, payload = arrived.header, arrived.payload[: arrived.header.nbytes]
        kept_valid = self._kept_base is not None and self._kept_base == header.base
        if header.dense < 0 and (destinations is None or kept_valid):
            return True
        if not payload.is_cpu:
            payload = payload.cpu()
        tensors_ = header.tensors
        kept = self.kept.match(header.index, arrived.table, header.dense) if kept_valid else None
        if kept is not None:
            at = kept.data.data_ptr()
            apply(payload, array.array("Q", [value for meta in tensors_
                                             for value in (at + meta.bucket_offset, meta.nbytes, unit_of(meta))]))
            arrived.payload = kept.data  # read from the kept copy as a dense bucket (``read`` folds it)
            return True
        if destinations is None:
            raise TransferError("a delta update reached a consumer that iterates views, and this receiver kept no "
                                "copy of the previous version to rebuild whole tensors from: it needs a full update",
                                peer="this receiver")
        self._views = False
        rows = array.array("Q")
        staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        held: list[Held] = []
        for meta in tensors_:
            destination = destinations.get(meta.name)
            if destination is None:
                raise DestinationError(f"no destination for received tensor {meta.name!r}: a delta update changes "
                                       "the tensor in place", name=meta.name)
            check_destination(meta, destination)
            if destination_fits(destination, DTYPES[meta.dtype], meta.shape):
                address = destination.data_ptr()
            else:  # another device, or a layout raw writes cannot fill: change a host copy, then copy it back
                if meta.name not in staged:
                    staged[meta.name] = (destination, tensors.as_byte_view(destination).cpu().clone())
                address = staged[meta.name][1].data_ptr()
            rows.extend((address + meta.offset, meta.nbytes, unit_of(meta)))
            held.append((meta, destination, meta.offset))
        if header.dense >= 0 and not staged and self._verifies(header) and self._model is not None:
            fold = BucketFold(self._model, arrived.table, header.dense)  # each piece hashed as soon as it is written
            apply(payload, rows, lambda piece: fold.piece(*held[piece]))
            fold.end()
            return False
        if header.dense >= 0:
            apply(payload, rows)
        else:  # a bucket sent dense: each piece copied to its place
            at = payload.data_ptr()
            tensors.copy_batch([value for row, meta in enumerate(tensors_)
                                for value in (rows[3 * row], at + meta.bucket_offset, meta.nbytes)], 0, 0)
        with torch.no_grad():
            for destination, host in staged.values():
                destination.copy_(host.view(destination.dtype).reshape(destination.shape))
        self._fold(header, arrived.table, held)
        return False

    def read(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None) -> None:
        """A bucket was read as a dense one: by views (its bytes are kept, for the next delta) or into
        ``destinations`` (recorded, for verifying what this receiver holds)."""
        header = arrived.header
        if destinations is None:
            kept = self.kept.replace(header.index, arrived.table, _layout(header))
            if arrived.payload.data_ptr() != kept.data.data_ptr():  # not read from the kept copy: keep it now
                for meta in header.tensors:
                    piece = arrived.payload[meta.bucket_offset:meta.bucket_offset + meta.nbytes]
                    kept.data[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece)
            self._fold(header, arrived.table, [(meta, kept.data, meta.bucket_offset) for meta in header.tensors])
            return
        self._views = False
        held: list[Held] = []
        for meta in header.tensors:
            destination = destinations.get(meta.name)
            if destination is None:  # the consumer's fallback took it: nothing this receiver can hash
                self._model = None
                return
            held.append((meta, destination, meta.offset))
        self._fold(header, arrived.table, held)

    def complete(self, header: codec.BucketHeader, *, receiver: int, peer: str) -> None:
        """The update's final header: verify what this receiver holds when due, then hold the new version."""
        if not header.model:
            return
        if header.base >= 0:
            self.delta_updates += 1
            if self._model is not None:
                actual = self._model.hexdigest()
                if actual != header.model:
                    raise DigestMismatchError(
                        f"rollout rank {receiver} holds tensors whose digest {actual[:16]} differs from version "
                        f"{header.version}'s {header.model[:16]} from {peer} after applying its changes: a "
                        "destination changed outside the engine, or the base was not what it claimed",
                        receiver=receiver, expected=header.model, actual=actual)
        self.held = (header.version, header.model)
        if self._views:
            self.kept.version, self.kept.model = header.version, header.model
            self.kept.truncate(header.index)


def _layout(header: codec.BucketHeader) -> int:
    """The size of the dense bucket a header's table describes."""
    return header.dense if header.dense >= 0 else header.nbytes


_ZEROS = bytes(1 << 16)


class BucketFold:
    """One bucket of what a receiver holds, folded into a model digest piece by piece, in the table's order: each
    piece's bytes read from where they live (on the host or a device), zeros for the padding between pieces — the
    bytes the sender's :class:`BaseCopies` hash."""

    def __init__(self, digest: UpdateDigest, table: bytes, nbytes: int) -> None:
        digest.begin_bucket(table, nbytes)
        self.digest, self.nbytes, self.at = digest, nbytes, 0

    def piece(self, meta: TensorMeta, source: torch.Tensor, start: int) -> None:
        _zeros(self.digest, meta.bucket_offset - self.at)
        if meta.nbytes:
            piece = tensors.as_byte_view(source)[start:start + meta.nbytes]
            if not piece.is_cpu:
                piece = piece.cpu()
            self.digest.update_at(piece.data_ptr(), meta.nbytes)
        self.at = meta.bucket_offset + meta.nbytes

    def end(self) -> None:
        _zeros(self.digest, self.nbytes - self.at)


def fold_bucket(digest: UpdateDigest, table: bytes, nbytes: int, pieces: Sequence[Held]) -> None:
    """Fold one bucket of what a receiver holds into a model digest (see :class:`BucketFold`)."""
    fold = BucketFold(digest, table, nbytes)
    for held in pieces:
        fold.piece(*held)
    fold.end()


def _zeros(digest: UpdateDigest, count: int) -> None:
    buffer = ctypes.c_char_p(_ZEROS)
    address = ctypes.cast(buffer, ctypes.c_void_p).value or 0
    while count > 0:
        step = min(count, len(_ZEROS))
        digest.update_at(address, step)
        count -= step
