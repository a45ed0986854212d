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
receiver holds, not of what crossed the wire — and a receiver that does not hold exactly that base refuses it before
writing. After applying, receivers sum what they hold and compare it with the new version's model digest, so a
destination changed behind the engine's back is found at the next delta update.

The model digest (:class:`ModelDigest`) is an XXH3-128 hash over every bucket's table, size and *keyed sum*: the sum,
modulo 2^64, of one term per 8-byte word of the bucket's pieces, each keyed by the word's place in the model
(:func:`piece_key`; the compiled helper documents the term). Its terms are independent, which is what makes
verification cheap: the sender updates a kept bucket's sum from the words that changed alone (no pass over the
model), and a receiver sums each stretch of a piece right after writing its changes, in the same pass. Like XXH3 it
finds corruption and bugs, not a forger.
"""

from __future__ import annotations

import array
import concurrent.futures
import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from weightsync.api.errors import DestinationError, DigestMismatchError, TransferError, WireError
from weightsync.core import codec, tensors
from weightsync.core.codec import TensorMeta
from weightsync.core.tensors import DTYPES, memoryview_at, memoryview_of
from weightsync.core.unpack import Arrived, Fallback, check_destination, destination_fits, typed_view

__all__ = ["BaseCopies", "BucketCopy", "ENCODER", "ModelDigest", "ReceiverDelta", "apply", "bucket_sum", "encode",
           "piece_key", "unit_of"]

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


KEY_STEP = 0x9E3779B97F4A7C15
"""The key of a piece's word is the key of the word before it plus this (modulo 2^64); the helper's ``KEY_STEP``."""
_MASK = (1 << 64) - 1


def piece_key(index: int, bucket_offset: int) -> int:
    """The key of the first word of the piece at ``bucket_offset`` of bucket ``index`` in keyed sums: each word of
    the model gets its own (pieces start on 8-byte boundaries)."""
    return (((index << 40) + bucket_offset // 8) * KEY_STEP + 0x6A09E667F3BCC909) & _MASK


SPLIT_BYTES = 1 << 20
"""A bucket of at least this many bytes is compared in two halves at once when the caller gives a second thread."""


def encode(rows: array.array[int], out: int, capacity: int,
           beside: concurrent.futures.Executor | None = None) -> tuple[int | None, int, int]:
    """Encode the pieces ``rows`` (flat ``(source address, base address, nbytes, unit, key)`` rows) into host memory
    at ``out``, and bring each base up to its source. Returns the encoding's length (None when it would not fit in
    ``capacity`` bytes), the changed bytes, and what the bases' keyed sum changed by (modulo 2^64; add it to the
    sum of the bases before). With ``beside`` (a thread), a large bucket's second half is compared there while this
    thread compares the first, and the two encodings are joined. Needs the compiled helper (``ENCODER``)."""
    total = sum(rows[row + 2] for row in range(0, len(rows), 5))
    if beside is None or total < SPLIT_BYTES:
        length, changed, sum_change, _ = _encode(rows, out, capacity, open_last=False)
        return length, changed, sum_change
    first, second, split = _halves(rows, total)
    share = capacity * sum(first[row + 2] for row in range(0, len(first), 5)) // total
    later = beside.submit(_encode, second, out + share, capacity - share, open_last=False)
    try:
        length, changed, sum_change, last = _encode(first, out, share, open_last=split is not None)
    finally:
        second_length, second_changed, second_change, _ = later.result()
    changed, sum_change = changed + second_changed, (sum_change + second_change) & _MASK
    if length is None or second_length is None:
        return None, changed, sum_change
    joint = b""
    skip = 0
    if split is not None:  # the split piece's first run after the split counts its gap from the first part's end
        view = memoryview_at(out + share, min(second_length, 20))
        run, skip = _varint(view, 0)
        if run:
            gap, skip = _varint(view, skip)
            at, unit = split
            joint = _put_varint(run) + _put_varint(gap + (at - last) // unit)
        else:
            skip = 0
    joined = length + len(joint) + second_length - skip
    if joined > capacity:
        return None, changed, sum_change
    ctypes.memmove(out + length + len(joint), out + share + skip, second_length - skip)
    if joint:
        ctypes.memmove(out + length, joint, len(joint))
    return joined, changed, sum_change


def _halves(rows: array.array[int], total: int) -> tuple[array.array[int], array.array[int], tuple[int, int] | None]:
    """``rows`` split where half of ``total`` is reached: a piece across the middle is split at a word boundary
    (its second part keyed from there). The third item is (the split's offset in that piece, its unit), or None
    when the halves meet between pieces."""
    half, before = total // 2, 0
    for row in range(0, len(rows), 5):
        source, base, nbytes, unit, key = rows[row:row + 5]
        if before + nbytes > half:
            at = (half - before) // 8 * 8
            if at == 0:
                return rows[:row], rows[row:], None
            first = rows[:row] + array.array("Q", (source, base, at, unit, key))
            rest = array.array("Q", (source + at, base + at, nbytes - at, unit, (key + at // 8 * KEY_STEP) & _MASK))
            return first, rest + rows[row + 5:], (at, unit)
        before += nbytes
    return rows, array.array("Q"), None


def _encode(rows: array.array[int], out: int, capacity: int, *, open_last: bool
            ) -> tuple[int | None, int, int, int]:
    helper = tensors._HELPER
    if helper is None:
        raise RuntimeError("delta encoding needs the compiled _stream_copy helper")
    changed, sum_change, last = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
    length = helper.weightsync_delta_encode(rows.buffer_info()[0], len(rows) // 5, out, capacity,
                                            ctypes.byref(changed), ctypes.byref(sum_change), int(open_last),
                                            ctypes.byref(last))
    return ((None if length == _MASK else int(length)), int(changed.value), int(sum_change.value),
            int(last.value))


def _varint(data: memoryview | bytes, at: int) -> tuple[int, int]:
    """The varint at ``at`` and where it ends; WireError if the data ends inside it or it is longer than 64 bits."""
    value = shift = 0
    while shift < 64:
        if at >= len(data):
            raise WireError("malformed delta bucket: it ends inside a run")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise WireError("malformed delta bucket: a varint longer than 64 bits")


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_MALFORMED = "malformed delta bucket: a run outside its tensor, or bytes missing or left over"


def apply(encoded: torch.Tensor, rows: array.array[int], *, summed: bool = False) -> int:
    """Apply the encoding ``encoded`` (a host uint8 tensor) to the pieces ``rows`` (flat ``(destination address,
    nbytes, unit, key)`` rows, in the encoding's order); ``WireError``, with nothing written, when it is malformed.
    With ``summed``, returns the pieces' keyed sum once written (the helper computes it in the same pass), else 0."""
    helper = tensors._HELPER
    count = len(rows) // 4
    if helper is None:
        data = bytes(memoryview_of(encoded)) if encoded.numel() else b""
        _walk(data, rows, write=False)
        _walk(data, rows, write=True)
        return _applied_sum(rows) if summed else 0
    total = ctypes.c_uint64(0)
    if helper.weightsync_delta_apply(encoded.data_ptr(), encoded.numel(), rows.buffer_info()[0], count,
                                     ctypes.byref(total) if summed else None) != 0:
        raise WireError(_MALFORMED)
    return int(total.value)


def bucket_sum(rows: array.array[int]) -> int:
    """The keyed sum of the host pieces ``rows`` (flat ``(address, nbytes, key)`` rows)."""
    helper = tensors._HELPER
    if helper is not None:
        return int(helper.weightsync_delta_sum(rows.buffer_info()[0], len(rows) // 3))
    return sum(_keyed_sum(rows[row], rows[row + 1], rows[row + 2]) for row in range(0, len(rows), 3)) & _MASK


def _applied_sum(rows: array.array[int]) -> int:
    """The keyed sum of the pieces :func:`apply` rows (``(address, nbytes, unit, key)``) point at."""
    return bucket_sum(array.array("Q", [value for row in range(0, len(rows), 4)
                                         for value in (rows[row], rows[row + 1], rows[row + 3])]))


def _keyed_sum(address: int, nbytes: int, key: int) -> int:
    """The helper's keyed sum of one piece in numpy (a receiver built without the helper), a few MiB at a time."""
    import numpy as np

    total, step = 0, 1 << 19
    with np.errstate(over="ignore"):
        for word in range(0, (nbytes + 7) // 8, step):
            size = min(8 * step, nbytes - 8 * word)
            padded = np.zeros((size + 7) // 8 * 8, dtype=np.uint8)
            padded[:size] = np.frombuffer(memoryview_at(address + 8 * word, size), dtype=np.uint8)
            keys = np.uint64((key + word * KEY_STEP) & _MASK) + np.arange(
                len(padded) // 8, dtype=np.uint64) * np.uint64(KEY_STEP)
            x = padded.view("<u8") ^ keys
            total += int(np.sum((x & np.uint64(0xFFFFFFFF)) * (x >> np.uint64(32)) + x, dtype=np.uint64))
    return total & _MASK


class ModelDigest:
    """The model digest of one version, folded bucket by bucket in order: an XXH3-128 hash over each bucket's table,
    dense size and keyed sum."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()

    def add(self, table: bytes, nbytes: int, total: int) -> None:
        self._hash.update(len(table).to_bytes(8, "little"))
        self._hash.update(table)
        self._hash.update(nbytes.to_bytes(8, "little"))
        self._hash.update(total.to_bytes(8, "little"))

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())


def _walk(data: bytes, rows: array.array[int], *, write: bool) -> None:
    """The helper's apply in Python (a receiver built without it): check, or write."""
    position = 0
    for row in range(0, len(rows), 4):
        address, nbytes, unit = rows[row], rows[row + 1], rows[row + 2]
        units, at = nbytes // unit, 0
        while True:
            run, position = _varint(data, position)
            if run == 0:
                break
            gap, position = _varint(data, position)
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
    total: int | None = None
    """Its keyed sum, when known (a sender keeps it up to date across deltas)."""

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def sum(self, index: int, metas: Sequence[TensorMeta]) -> int:
        """Its keyed sum (it is bucket ``index``, whose pieces are ``metas``), computed and remembered."""
        self.total = held_sum(index, [(meta, self.data, meta.bucket_offset) for meta in metas])
        return self.total


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
        """A copy for bucket ``index`` to be rewritten whole: the kept one when it lines up, else a fresh zeroed one
        (the layout changed, or the copy is new). Its sum is unknown until it is computed again."""
        kept = self.match(index, table, nbytes)
        if kept is not None:
            kept.total = None
        else:
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
    destinations. A tensor with no destination there goes to the consumer's fallback as in a full update: the
    receiver keeps a host copy of each such tensor (``placed``), brings it up to the new version and hands the
    fallback the whole tensor. A receiver that does not hold the update's base refuses it before writing anything.
    """

    def __init__(self, *, verify_every: int) -> None:
        self.verify_every = verify_every
        self.held: tuple[int, str] | None = None
        """(version, model digest) of what this receiver holds; None while an update is under way or after one
        failed."""
        self.kept = BaseCopies()
        self.placed: dict[str, torch.Tensor] = {}
        """Host copies (bytes) of the tensors a ``copy_into`` consumer's fallback took, as of this update (during
        one) or the held version: what changes to them apply to."""
        self._placed_base: dict[str, torch.Tensor] = {}
        self.delta_updates = 0
        self._base: tuple[int, str] | None = None
        self._kept_base: int | None = None
        self._model: ModelDigest | None = None
        """This update's model digest, folded bucket by bucket as each is final here; None when this update is not
        verified (a full update, not due, or a bucket this receiver cannot sum)."""
        self._views = True

    def begin(self) -> None:
        """A new update starts: until it completes, this receiver holds no version it can vouch for."""
        self._base, self.held = self.held, None
        self._kept_base, self.kept.version = self.kept.version, None
        self._placed_base, self.placed = self.placed, {}
        self._model = None
        self._views = True

    def _verifies(self, header: codec.BucketHeader) -> bool:
        """Whether this update's model digest is being folded (decided at its first bucket: delta updates, every
        ``verify_every``-th of them)."""
        if header.index == 0:
            due = header.base >= 0 and (self.delta_updates + 1) % self.verify_every == 0
            self._model = ModelDigest() if due else None
        return self._model is not None

    def _fold(self, header: codec.BucketHeader, table: bytes, pieces: Sequence[Held]) -> None:
        if self._verifies(header) and self._model is not None:
            self._model.add(table, _layout(header), held_sum(header.index, pieces))

    def check_base(self, header: codec.BucketHeader, peer: str) -> None:
        """Refuse a delta update against a base this receiver does not hold (before anything is written)."""
        if header.base >= 0 and self._base != (header.base, header.base_model):
            held = f"version {self._base[0]}" if self._base is not None else "no version it can vouch for"
            raise TransferError(f"{peer} sent changes against version {header.base}, but this receiver holds {held}: "
                                "it needs a full update", peer=peer)

    def take(self, arrived: Arrived, destinations: Mapping[str, torch.Tensor] | None,
             fallback: Fallback | None = None) -> bool:
        """A bucket of a delta update, before the consumer reads it. True: the consumer reads it as a dense bucket
        (a delta applied to the kept copy is read from there); False: it went straight into ``destinations`` and
        is done (a tensor with no destination handed to ``fallback`` whole). Every bucket of the update goes one
        way: a tensor split across buckets may arrive partly dense, partly as changes, and each piece must land in
        place."""
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
            apply(payload, array.array("Q", [value for meta in tensors_ for value in (
                at + meta.bucket_offset, meta.nbytes, unit_of(meta), piece_key(header.index, meta.bucket_offset))]))
            arrived.payload = kept.data  # read from the kept copy as a dense bucket (``read`` folds it)
            return True
        if destinations is None:
            raise TransferError("a delta update reached a consumer that iterates views, and this receiver kept no "
                                "copy of the previous version to rebuild whole tensors from: it needs a full update",
                                peer="this receiver")
        self._views = False
        rows = array.array("Q")
        # A destination on another device: a host copy of each piece's bytes (not its whole tensor) is changed,
        # then copied back. One in a layout raw writes cannot fill: a host copy of all of it, the same way.
        windows: list[tuple[torch.Tensor, torch.Tensor]] = []
        whole: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        held: list[Held] = []
        placed: list[tuple[TensorMeta, torch.Tensor]] = []
        for meta in tensors_:
            destination = destinations.get(meta.name)
            if destination is None:
                if fallback is None:
                    raise DestinationError(f"no destination for received tensor {meta.name!r} (and no fallback)",
                                           name=meta.name)
                copy = self._placed(meta, fresh=header.dense < 0)
                rows.extend((copy.data_ptr() + meta.offset, meta.nbytes, unit_of(meta),
                             piece_key(header.index, meta.bucket_offset)))
                held.append((meta, copy, meta.offset))
                placed.append((meta, copy))
                continue
            check_destination(meta, destination)
            dtype = DTYPES[meta.dtype]
            if destination_fits(destination, dtype, meta.shape):
                address = destination.data_ptr() + meta.offset
            elif destination_fits(destination, dtype, meta.shape, anywhere=True):
                window = tensors.as_byte_view(destination)[meta.offset:meta.offset + meta.nbytes]
                # A dense bucket overwrites the piece: nothing to read back first.
                host = window.cpu() if header.dense >= 0 else torch.empty(meta.nbytes, dtype=torch.uint8)
                windows.append((window, host))
                address = host.data_ptr()
            else:
                if meta.name not in whole:
                    whole[meta.name] = (destination, tensors.as_byte_view(destination).cpu().clone())
                address = whole[meta.name][1].data_ptr() + meta.offset
            rows.extend((address, meta.nbytes, unit_of(meta), piece_key(header.index, meta.bucket_offset)))
            held.append((meta, destination, meta.offset))
        # Verified here, from the bytes just written (a piece changed in a host copy is summed there: the copy goes
        # back unchanged), unless a whole tensor was copied: then from what the destinations hold, below.
        verified = not whole and self._verifies(header)
        total = 0
        if header.dense >= 0:  # with ``verified``, each stretch summed right after its changes, in one pass
            total = apply(payload, rows, summed=verified)
        else:  # a bucket sent dense: each piece copied to its place
            at = payload.data_ptr()
            tensors.copy_batch([value for row, meta in enumerate(tensors_)
                                for value in (rows[4 * row], at + meta.bucket_offset, meta.nbytes)], 0, 0)
            if verified:
                total = _applied_sum(rows)
        with torch.no_grad():
            for window, host in windows:
                window.copy_(host)
            for destination, host in whole.values():
                destination.copy_(host.view(destination.dtype).reshape(destination.shape))
        if verified and self._model is not None:
            self._model.add(arrived.table, _layout(header), total)
        elif whole:
            self._fold(header, arrived.table, held)
        for meta, copy in placed:
            if meta.offset + meta.nbytes == meta.total_nbytes and fallback is not None:  # its last piece: whole now
                fallback(meta.name, typed_view(copy, DTYPES[meta.dtype], meta.shape))
        return False

    def _placed(self, meta: TensorMeta, *, fresh: bool) -> torch.Tensor:
        """The host copy a piece of a tensor without a destination is written to: this update's, the base's (to
        apply changes to), or, for a piece sent dense (``fresh``), a new one."""
        copy = self.placed.get(meta.name)
        if copy is None:
            copy = self._placed_base.pop(meta.name, None)
            if copy is None or copy.numel() != meta.total_nbytes:
                if not fresh:
                    raise TransferError(f"changes to {meta.name!r} arrived, but this receiver kept no copy of it to "
                                        "apply them to (its fallback took it): it needs a full update",
                                        peer="this receiver")
                copy = torch.empty(meta.total_nbytes, dtype=torch.uint8)
            self.placed[meta.name] = copy
        return copy

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
            if destination is None:  # the consumer's fallback took it: kept, for the next delta update
                destination = self._placed(meta, fresh=True)
                with torch.no_grad():
                    destination[meta.offset:meta.offset + meta.nbytes].copy_(
                        arrived.payload[meta.bucket_offset:meta.bucket_offset + meta.nbytes])
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
        self._placed_base = {}  # tensors the fallback no longer takes
        if self._views:
            self.kept.version, self.kept.model = header.version, header.model
            self.kept.truncate(header.index)


def _layout(header: codec.BucketHeader) -> int:
    """The size of the dense bucket a header's table describes."""
    return header.dense if header.dense >= 0 else header.nbytes


def held_sum(index: int, pieces: Sequence[Held]) -> int:
    """The keyed sum of bucket ``index``'s pieces where a receiver holds them (a device piece is read back first, a
    piece of a non-contiguous tensor read from a contiguous copy)."""
    rows, alive = array.array("Q"), []  # every piece stays referenced until summed: some are copies made here
    for meta, source, start in pieces:
        piece = tensors.as_byte_view(source)[start:start + meta.nbytes]
        if not piece.is_cpu:
            piece = piece.cpu()
        alive.append(piece)
        rows.extend((piece.data_ptr(), meta.nbytes, piece_key(index, meta.bucket_offset)))
    return bucket_sum(rows)
