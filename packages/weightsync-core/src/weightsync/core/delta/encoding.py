"""Delta updates: a bucket travels as the units that changed since the base version, applied in place on arrival.

Between two RL steps most low-precision weights keep their exact bits, so an update can carry only what changed.
The sender keeps a host copy of the base version, bucket by bucket in the bucket's own layout (:class:`~weightsync.core.delta.copies.BaseCopies`;
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
from collections.abc import Callable, Iterator, Sequence

import torch
import xxhash

from weightsync.api.errors import WireError
from weightsync.core import native
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.tensors import DTYPES, as_byte_view, memoryview_at, memoryview_of

__all__ = ["ENCODER", "Held", "ModelDigest", "apply", "applied_sum", "bucket_sum", "encode", "held_sum", "piece_key",
           "unit_of"]

_UNITS = {name: min(dtype.itemsize, 8) for name, dtype in DTYPES.items()}


def _encoder() -> str:
    if not native.compiled():
        return f"unavailable ({native.HELPER_MISSING}): delta updates send every bucket dense"
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


def encode(rows: array.array[int], out: int, capacity: int, beside: concurrent.futures.Executor | None = None, *,
           segments: array.array[int] | None = None, parts: int = 0) -> tuple[int | None, int, int, list[int]]:
    """Encode the pieces ``rows`` (flat ``(source address, base address, nbytes, unit, key)`` rows) into host memory
    at ``out``, and bring each base up to its source. Returns the encoding's length (None when it would not fit in
    ``capacity`` bytes), the changed bytes, what the bases' keyed sum changed by (modulo 2^64; add it to the sum of
    the bases before), and with ``segments`` what each of ``parts`` parts' keyed sum changed by (the segments of
    :func:`weightsync.core.delta.parts.part_segments`). With ``beside`` (a thread), a large bucket's second half is
    compared there while this thread compares the first, and the two encodings are joined. Needs the compiled
    helper (``ENCODER``)."""
    total = sum(rows[row + 2] for row in range(0, len(rows), 5))
    if beside is None or total < SPLIT_BYTES:
        length, changed, sum_change, _, part_changes = native.delta_encode(rows, out, capacity, open_last=False,
                                                                           segments=segments, parts=parts)
        return length, changed, sum_change, part_changes
    first, second, split = _halves(rows, total)
    first_segments, second_segments = (None, None) if segments is None else _split_segments(
        segments, len(first) // 5, split[0] if split else 0)
    share = capacity * sum(first[row + 2] for row in range(0, len(first), 5)) // total
    later = beside.submit(native.delta_encode, second, out + share, capacity - share, open_last=False,
                          segments=second_segments, parts=parts)
    try:
        length, changed, sum_change, last, part_changes = native.delta_encode(
            first, out, share, open_last=split is not None, segments=first_segments, parts=parts)
    finally:
        second_length, second_changed, second_change, _, second_parts = later.result()
    changed, sum_change = changed + second_changed, (sum_change + second_change) & _MASK
    part_changes = [(one + other) & _MASK for one, other in zip(part_changes, second_parts)]
    if length is None or second_length is None:
        return None, changed, sum_change, part_changes
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
        return None, changed, sum_change, part_changes
    native.copy_bytes(out + length + len(joint), out + share + skip, second_length - skip)
    if joint:
        native.copy_bytes(out + length, joint, len(joint))
    return joined, changed, sum_change, part_changes


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


def _split_segments(segments: array.array[int], pieces: int, at: int) -> tuple[array.array[int], array.array[int]]:
    """``segments`` for the first of :func:`_halves`' halves (its ``pieces`` pieces, the last of them cut ``at``
    bytes in when ``at``) and for the second."""
    position = 0
    for _ in range(pieces - (1 if at else 0)):
        position += 1 + 2 * segments[position]
    if not at:
        return segments[:position], segments[position:]
    count = segments[position]
    pairs = segments[position + 1:position + 1 + 2 * count]
    first, second = array.array("Q"), array.array("Q")
    for end, mask in zip(pairs[::2], pairs[1::2]):
        if not first or first[-2] < at:
            first.extend((min(end, at), mask))
        if end > at:
            second.extend((end - at, mask))
    return (segments[:position] + array.array("Q", [len(first) // 2]) + first,
            array.array("Q", [len(second) // 2]) + second + segments[position + 1 + 2 * count:])


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


def apply(encoded: torch.Tensor, rows: array.array[int], *, summed: bool = False,
          held: array.array[int] | None = None) -> int:
    """Apply the encoding ``encoded`` (a host uint8 tensor) to the pieces ``rows`` (flat ``(destination address,
    nbytes, unit, key)`` rows, in the encoding's order); ``WireError``, with nothing written, when it is malformed.
    With ``summed``, returns the pieces' keyed sum once written (the helper computes it in the same pass), else 0.
    With ``held`` (:func:`weightsync.core.delta.parts.held_rows`), only the ranges of each piece it names held are
    written and summed: a worker that keeps its part alone."""
    if not native.compiled():
        data = bytes(memoryview_of(encoded)) if encoded.numel() else b""
        _walk(data, rows, write=False)
        _walk(data, rows, write=True, held=held)
        return applied_sum(rows, held) if summed else 0
    total = native.delta_apply(encoded.data_ptr(), encoded.numel(), rows, summed=summed, held=held)
    if total is None:
        raise WireError(_MALFORMED)
    return total


def bucket_sum(rows: array.array[int]) -> int:
    """The keyed sum of the host pieces ``rows`` (flat ``(address, nbytes, key)`` rows)."""
    if native.compiled():
        return native.delta_sum(rows)
    return sum(_keyed_sum(rows[row], rows[row + 1], rows[row + 2]) for row in range(0, len(rows), 3)) & _MASK


def applied_sum(rows: array.array[int], held: array.array[int] | None = None) -> int:
    """The keyed sum of the pieces :func:`apply` rows (``(address, nbytes, unit, key)``) point at (of their ranges
    ``held`` names held, when given)."""
    sums = array.array("Q")
    for row, ranges in zip(range(0, len(rows), 4), _ranges(rows, held)):
        for start, end in ranges:
            sums.extend((rows[row] + start, end - start, (rows[row + 3] + start // 8 * KEY_STEP) & _MASK))
    return bucket_sum(sums)


def _ranges(rows: array.array[int], held: array.array[int] | None) -> Iterator[list[tuple[int, int]]]:
    """Each :func:`apply` row's held ranges ``(start, end)``: the whole piece without ``held``."""
    at = 0
    for row in range(0, len(rows), 4):
        if held is None:
            yield [(0, rows[row + 1])]
            continue
        count, start, ranges = held[at], 0, []
        for pair in range(at + 1, at + 1 + 2 * count, 2):
            if held[pair + 1] and held[pair] > start:
                ranges.append((start, held[pair]))
            start = held[pair]
        at += 1 + 2 * count
        yield ranges


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


def _walk(data: bytes, rows: array.array[int], *, write: bool, held: array.array[int] | None = None) -> None:
    """The helper's apply in Python (a receiver built without it): check, or write (``held``'s ranges alone)."""
    position = 0
    for row, ranges in zip(range(0, len(rows), 4), _ranges(rows, held)):
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
                for start, end in ranges:  # the run's bytes inside each held range
                    low, high = max(start, at * unit), min(end, (at + run) * unit)
                    if low < high:
                        native.copy_bytes(address + low, data[position + low - at * unit:position + high - at * unit],
                                          high - low)
            position += run * unit
            at += run
    if position != len(data):
        raise WireError("malformed delta bucket: bytes left over after its last tensor")


Held = tuple[TensorMeta, torch.Tensor, int]
"""Where one piece of the received version lives: ``(meta, tensor, start)``, its bytes ``start:+meta.nbytes`` of
the tensor's bytes (a destination and the piece's offset in it, or a kept bucket and the piece's bucket offset)."""


def held_sum(index: int, pieces: Sequence[Held],
             ranges: Callable[[TensorMeta], Sequence[tuple[int, int]]] | None = None) -> int:
    """The keyed sum of bucket ``index``'s pieces where a receiver holds them (a device piece is read back first, a
    piece of a non-contiguous tensor read from a contiguous copy); with ``ranges``, of each piece's ranges it gives
    (``(start, end)`` from the piece's first byte, starting on words: a worker's part, :mod:`.parts`)."""
    rows, alive = array.array("Q"), []  # every piece stays referenced until summed: some are copies made here
    for meta, source, start in pieces:
        piece = as_byte_view(source)[start:start + meta.nbytes]
        if not piece.is_cpu:
            piece = piece.cpu()
        alive.append(piece)
        key = piece_key(index, meta.bucket_offset)
        for low, high in ((0, meta.nbytes),) if ranges is None else ranges(meta):
            rows.extend((piece.data_ptr() + low, high - low, (key + low // 8 * KEY_STEP) & _MASK))
    return bucket_sum(rows)
