"""Delta updates into a worker that keeps its part alone (``weightsync.core.delta.parts``): its held ranges of each
piece, the apply that writes and sums only them (the helper's and Python's), and a kept copy that takes memory only
where it was written, read from the kernel's accounting of the process's mappings."""

from __future__ import annotations

import array
import concurrent.futures

import pytest
import torch

from weightsync.api.parts import Part
from weightsync.core import native
from weightsync.core.delta import encoding as delta
from weightsync.core.delta.copies import BaseCopies
from weightsync.core.delta.parts import MAX_RANGES, PartWords, part_segments
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.parts import PartLayout
from weightsync.core.wire.tensors import as_byte_view

pytestmark = pytest.mark.skipif(native.HELPER is None, reason="the compiled helper is not built here")

SHAPES = {"rows": (64, 48), "columns": (64, 48), "norm": (48,), "odd": (6, 5)}


def words(rank: int) -> PartWords:
    """Rank ``rank`` of two: half of ``rows`` along rows, half of ``columns`` and ``odd`` along columns, ``norm``
    whole."""
    part = Part.split(SHAPES, dims={"rows": 0, "columns": 1, "odd": 0}, rank=rank, parts=2)
    return PartWords(PartLayout(PartPlan.of(part, rank)))


def meta(name: str, offset: int = 0, nbytes: int | None = None, bucket_offset: int = 0) -> TensorMeta:
    total = 2 * int(torch.tensor(SHAPES[name]).prod())
    return TensorMeta(name, "bfloat16", SHAPES[name], offset, total if nbytes is None else nbytes, total,
                      bucket_offset)


def test_held_ranges_are_the_parts_runs_rounded_out_to_words() -> None:
    half = 32 * 48 * 2
    assert words(0).ranges(meta("rows")) == ((0, half),)
    assert words(1).ranges(meta("rows")) == ((half, 2 * half),)
    # A piece of the tensor (split across buckets): its ranges count from its own first byte.
    assert words(1).ranges(meta("rows", offset=1000, nbytes=4000)) == ((half - 1000, 4000),)
    assert words(0).ranges(meta("rows", offset=half, nbytes=1000)) == ()
    # A block of columns is a run per row: more than MAX_RANGES of them, so the whole piece.
    assert 64 > MAX_RANGES and words(0).ranges(meta("columns")) == ((0, 64 * 48 * 2),)
    assert words(1).ranges(meta("norm")) == ((0, 96),)
    # 6 rows of 5 bf16 in halves: the cut at byte 30 lies inside the word at 24, which both sides hold.
    assert words(0).ranges(meta("odd")) == ((0, 32),)
    assert words(1).ranges(meta("odd")) == ((24, 60),)


def fill(metas: list[TensorMeta], seed: int) -> torch.Tensor:
    size = metas[-1].bucket_offset + metas[-1].nbytes
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def bucket_metas(names: tuple[str, ...] = tuple(SHAPES)) -> list[TensorMeta]:
    metas, at = [], 0
    for name in names:
        piece = meta(name, bucket_offset=at)
        metas.append(piece)
        at = (at + piece.nbytes + 255) & ~255
    return metas


def changed(bucket: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    mask = torch.rand(bucket.numel(), generator=torch.Generator().manual_seed(seed)) < fraction
    out = bucket.clone()
    out[mask] += 1
    return out


def encoded_changes(metas: list[TensorMeta], old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    base = old.clone()
    rows = array.array("Q")
    for piece in metas:
        rows.extend((new.data_ptr() + piece.bucket_offset, base.data_ptr() + piece.bucket_offset, piece.nbytes,
                     delta.unit_of(piece), delta.piece_key(3, piece.bucket_offset)))
    out = torch.empty(new.numel() * 2, dtype=torch.uint8)
    length, _, _, _ = delta.encode(rows, out.data_ptr(), out.numel())
    assert length is not None
    return out[:length].clone()


def held_mask(part: PartWords, metas: list[TensorMeta], size: int) -> torch.Tensor:
    mask = torch.zeros(size, dtype=torch.bool)
    for piece in metas:
        for start, stop in part.ranges(piece):
            mask[piece.bucket_offset + start:piece.bucket_offset + stop] = True
    return mask


@pytest.mark.parametrize("python", [False, True], ids=["helper", "python"])
@pytest.mark.parametrize("rank", [0, 1])
def test_the_apply_writes_and_sums_the_held_ranges_alone(monkeypatch: pytest.MonkeyPatch, python: bool,
                                                          rank: int) -> None:
    """Into a copy that holds rank ``rank``'s ranges of the old version (zeros elsewhere), the changes to a new one
    leave exactly the new version's held ranges and zeros elsewhere, and the sum returned is the part's keyed sum of
    the new version, which the sender computes from its own whole copy."""
    metas = bucket_metas()
    old = fill(metas, seed=1)
    new = changed(old, 0.05, seed=2)
    encoded = encoded_changes(metas, old, new)
    part = words(rank)
    mask = held_mask(part, metas, old.numel())
    assert 0.3 < mask.float().mean() < 0.9  # a part, not the whole
    kept = torch.where(mask, old, torch.zeros_like(old))
    if python:
        monkeypatch.setattr(native, "HELPER", None)
    rows = array.array("Q", [value for piece in metas for value in (
        kept.data_ptr() + piece.bucket_offset, piece.nbytes, delta.unit_of(piece),
        delta.piece_key(3, piece.bucket_offset))])
    total = delta.apply(encoded, rows, summed=True, held=part.segments(metas))
    assert torch.equal(kept[mask], new[mask])
    assert not kept[~mask].any()
    assert total == part.bucket_sum(3, metas, new)
    # Negative control: the whole apply writes past the held ranges (the new version has changes there).
    whole = kept.clone()
    delta.apply(encoded, rows_for(metas, whole))
    assert whole[~mask].any()


def rows_for(metas: list[TensorMeta], data: torch.Tensor) -> array.array[int]:
    return array.array("Q", [value for piece in metas for value in (
        data.data_ptr() + piece.bucket_offset, piece.nbytes, delta.unit_of(piece),
        delta.piece_key(3, piece.bucket_offset))])


def test_the_parts_sums_add_up_to_the_whole_where_they_do_not_overlap() -> None:
    """Row-split and whole pieces only (no word held by both): the two parts' keyed sums of a bucket add up to its
    keyed sum, so neither part's sum leaves out a word of its ranges or counts one twice."""
    metas = [meta("rows", bucket_offset=0)]
    data = fill(metas, seed=5)
    whole = delta.bucket_sum(array.array("Q", [data.data_ptr(), metas[0].nbytes, delta.piece_key(3, 0)]))
    assert (words(0).bucket_sum(3, metas, data) + words(1).bucket_sum(3, metas, data)) % (1 << 64) == whole


@pytest.mark.parametrize("halves", [False, True], ids=["whole", "halves"])
def test_the_encoder_keeps_each_parts_sum_up_to_date(monkeypatch: pytest.MonkeyPatch, halves: bool) -> None:
    """What the encoder says each part's keyed sum changed by, added to the part's sum of the old version, is the
    part's sum of the new one (taken from scratch), for the row-split, column-split, whole and odd pieces of both
    ranks; also where the bucket is compared in two halves split inside a piece (``rows``, whose halves the two
    ranks hold). The whole sum's change is the encoder's as before. Negative control: the segments of rank 0 alone
    give rank 1 no change."""
    metas = bucket_metas(("columns", "rows", "norm", "odd"))
    old = fill(metas, seed=11)
    new = changed(old, 0.05, seed=12)
    parts = [words(0), words(1)]
    base = old.clone()
    rows = array.array("Q")
    for piece in metas:
        rows.extend((new.data_ptr() + piece.bucket_offset, base.data_ptr() + piece.bucket_offset, piece.nbytes,
                     delta.unit_of(piece), delta.piece_key(3, piece.bucket_offset)))
    if halves:
        monkeypatch.setattr(delta, "SPLIT_BYTES", 1024)
    out = torch.empty(new.numel() * 2, dtype=torch.uint8)
    with concurrent.futures.ThreadPoolExecutor(1) as beside:
        length, _, sum_change, part_changes = delta.encode(rows, out.data_ptr(), out.numel(), beside,
                                                           segments=part_segments(parts, metas), parts=2)
    assert length is not None and all(torch.equal(base[piece.bucket_offset:piece.bucket_offset + piece.nbytes],
                                                  new[piece.bucket_offset:piece.bucket_offset + piece.nbytes])
                                      for piece in metas)
    assert all(change != 0 for change in part_changes)
    for part, change in zip(parts, part_changes):
        assert (part.bucket_sum(3, metas, old) + change) % (1 << 64) == part.bucket_sum(3, metas, new)
    whole = [array.array("Q", [data.data_ptr() + piece.bucket_offset, piece.nbytes,
                               delta.piece_key(3, piece.bucket_offset)]) for data in (old, new) for piece in metas]
    old_sum = sum(delta.bucket_sum(row) for row in whole[:len(metas)])
    new_sum = sum(delta.bucket_sum(row) for row in whole[len(metas):])
    assert (old_sum + sum_change - new_sum) % (1 << 64) == 0
    # Negative control: rank 1's bit never set, so it gets no change.
    base = old.clone()
    rows[1::5] = array.array("Q", [base.data_ptr() + piece.bucket_offset for piece in metas])
    _, _, _, only_first = delta.encode(rows, out.data_ptr(), out.numel(), segments=part_segments(parts[:1], metas),
                                       parts=2)
    assert only_first[0] == part_changes[0] and only_first[1] == 0


def resident_bytes(tensor: torch.Tensor) -> int:
    """The resident bytes of the mapping that holds ``tensor``, as the kernel counts them (``/proc/self/smaps``)."""
    address = tensor.data_ptr()
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                low, high = (int(value, 16) for value in fields[0].split("-"))
                mapping = (low, high) if low <= address < high else None
            elif mapping is not None and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError("no mapping holds the tensor")


def test_a_partial_copy_takes_memory_where_it_was_written_alone() -> None:
    """A bucket of a copy that holds a part is a mapping of its own whose pages the kernel counts once written, not
    once read: 32 MiB of which 8 are written take 8 MiB; the whole copy's (``torch.zeros``) take all 32 (the
    negative control)."""
    nbytes, written = 32 << 20, 8 << 20
    partial = BaseCopies(partial=True)
    bucket = partial.replace(0, b"table", nbytes).data
    assert resident_bytes(bucket) < 1 << 20
    bucket[:written] = 7
    assert not bucket[written:].any()  # read, the unwritten pages are zeros and still take no memory
    assert written <= resident_bytes(bucket) < written + (1 << 20)
    whole = BaseCopies().replace(0, b"table", nbytes).data
    assert resident_bytes(whole) >= nbytes
    assert as_byte_view(whole).numel() == nbytes
