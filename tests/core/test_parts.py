"""Parts without processes: the byte runs a part's boxes select (against a boolean mask built by torch slicing), the
part sums folded whole, piece by piece and bucket by bucket, what they catch and what they must not, the value
types' validation, and the parts the manager hands out at setup."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence

import msgspec
import pytest
import torch

from weightsync.api.errors import ConfigError, PartMismatchError, TopologyError
from weightsync.api.parts import PART_KEY, Part, Region
from weightsync.api.types import RankArgs, WorkerMetadata
from weightsync.core.control.parts import declared_parts, with_declared_parts
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.parts import PartSums, byte_runs, check_sums
from weightsync.core.wire.tensors import as_byte_view, dtype_name, memoryview_of

Box = tuple[tuple[int, ...], tuple[int, ...]]
Stream = list[tuple[str, torch.Tensor]]
DTYPE_OF_ITEMSIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}
SUM_BYTES = 8


# --- helpers -----------------------------------------------------------------------------------------------------


def random_shape(rng: random.Random) -> tuple[int, ...]:
    """0-d to 3-d, extents 1-5 and now and then 0."""
    return tuple(0 if rng.random() < 0.08 else rng.randint(1, 5) for _ in range(rng.randint(0, 3)))


def random_box(rng: random.Random, shape: Sequence[int]) -> Box:
    """A box that fits ``shape``: along each dimension the whole extent, nothing, or a random slice."""
    start: list[int] = []
    size: list[int] = []
    for extent in shape:
        pick = rng.random()
        if pick < 0.35:
            first, length = 0, extent
        elif pick < 0.45:
            first, length = rng.randint(0, extent), 0
        else:
            first = rng.randint(0, extent)
            length = rng.randint(0, extent - first)
        start.append(first)
        size.append(length)
    return tuple(start), tuple(size)


def element_mask(boxes: Sequence[Box], shape: Sequence[int]) -> torch.Tensor:
    """The elements ``boxes`` select, by plain torch slicing (the reference)."""
    mask = torch.zeros(tuple(shape), dtype=torch.bool)
    for start, size in boxes:
        mask[tuple(slice(first, first + length) for first, length in zip(start, size))] = True
    return mask


def byte_mask(boxes: Sequence[Box], shape: Sequence[int], itemsize: int) -> torch.Tensor:
    """The row-major bytes ``boxes`` select."""
    return element_mask(boxes, shape).reshape(-1).repeat_interleave(itemsize)


def runs_mask(runs: tuple[list[int], list[int]], total: int) -> torch.Tensor:
    """The bytes ``runs`` cover, after checking they are non-empty, sorted, disjoint and not adjacent (merged)."""
    starts, ends = runs
    assert len(starts) == len(ends)
    for at, (low, high) in enumerate(zip(starts, ends)):
        assert 0 <= low < high <= total, (low, high, total)
        if at:
            assert ends[at - 1] < low, f"runs {at - 1} and {at} overlap or touch: {runs}"
    covered = torch.zeros(total, dtype=torch.bool)
    for low, high in zip(starts, ends):
        covered[low:high] = True
    return covered


def random_tensor(generator: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    tensor = torch.empty(tuple(shape), dtype=dtype)
    data = as_byte_view(tensor)
    data.copy_(torch.randint(0, 256, (data.numel(),), dtype=torch.uint8, generator=generator))
    return tensor


def meta_of(name: str, tensor: torch.Tensor, low: int, high: int, bucket_offset: int = 0) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset=low,
                      nbytes=high - low, total_nbytes=tensor.numel() * tensor.element_size(),
                      bucket_offset=bucket_offset)


def cut_points(rng: random.Random | None, total: int) -> list[int]:
    """0, some random interior cuts (none when ``rng`` is None), ``total``."""
    if rng is None or total < 2:
        return [0, total]
    inner = rng.sample(range(1, total), rng.randint(0, min(total - 1, 6)))
    return [0, *sorted(inner), total]


def fold_stream(plan: PartPlan, stream: Stream, rng: random.Random | None = None) -> PartSums:
    """Fold every tensor of ``stream`` in order, whole (``rng`` None) or cut into consecutive random pieces."""
    sums = PartSums(plan)
    for name, tensor in stream:
        data = as_byte_view(tensor)
        cuts = cut_points(rng, data.numel())
        for low, high in zip(cuts, cuts[1:]):
            sums.fold(meta_of(name, tensor, low, high), data.data_ptr() + low)
    return sums


def fold_buckets(plan: PartPlan, stream: Stream, rng: random.Random) -> PartSums:
    """Fold ``stream`` as a packer sends it: its bytes end to end, cut into random buckets, each folded with
    ``fold_all`` from its own buffer (a tensor crossing a bucket's edge travels as pieces)."""
    datas = [as_byte_view(tensor) for _, tensor in stream]
    total = sum(data.numel() for data in datas)
    edges = cut_points(rng, total)
    sums = PartSums(plan)
    for low, high in zip(edges, edges[1:]):
        bucket = torch.zeros(high - low, dtype=torch.uint8)
        metas: list[TensorMeta] = []
        begin = 0  # where the current tensor starts in the stream
        for (name, tensor), data in zip(stream, datas):
            first, last = max(low, begin), min(high, begin + data.numel())
            empty_here = data.numel() == 0 and low <= begin and (begin < high or high == total)
            if first < last or empty_here:
                bucket[first - low:last - low] = data[first - begin:last - begin]
                metas.append(meta_of(name, tensor, first - begin, last - begin, bucket_offset=first - low))
            begin += data.numel()
        sums.fold_all(metas, bucket.data_ptr())
    return sums


def random_stream(rng: random.Random, generator: torch.Generator, count: int) -> tuple[Stream, Part]:
    """``count`` random tensors and a random part of them: each tensor absent (whole), ``()`` (nothing) or 1-3
    boxes."""
    stream: Stream = []
    tensors: dict[str, tuple[Region, ...]] = {}
    for index in range(count):
        shape = random_shape(rng)
        name = f"layer.{index}.weight"
        stream.append((name, random_tensor(generator, shape, DTYPE_OF_ITEMSIZE[rng.choice((1, 2, 4))])))
        pick = rng.random()
        if pick < 0.2:
            tensors[name] = ()
        elif pick < 0.8:
            tensors[name] = tuple(Region(*random_box(rng, shape)) for _ in range(rng.randint(1, 3)))
    return stream, Part(tensors=tensors)


def selected_bytes(part: Part, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` ``part`` holds, as a mask (the reference)."""
    regions = part.regions(name)
    if regions is None:
        return torch.ones(tensor.numel() * tensor.element_size(), dtype=torch.bool)
    boxes = [(region.start, region.size) for region in regions]
    return byte_mask(boxes, tensor.shape, tensor.element_size())


# --- byte runs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_byte_runs_select_exactly_the_boxes(seed: int) -> None:
    rng = random.Random(seed)
    seen = {"scalar": 0, "empty box": 0, "whole trailing": 0, "overlap": 0, "merged": 0}
    for case in range(250):
        shape = random_shape(rng)
        itemsize = rng.choice((1, 2, 4))
        boxes = [random_box(rng, shape) for _ in range(rng.randint(1, 3))]
        runs = byte_runs(boxes, shape, itemsize, name="w")
        expected = byte_mask(boxes, shape, itemsize)
        got = runs_mask(runs, len(expected))
        assert torch.equal(got, expected), f"case {case}: shape={shape} itemsize={itemsize} boxes={boxes} {runs}"
        # what the generator must have covered for this to mean anything
        seen["scalar"] += not shape
        seen["empty box"] += any(0 in size for _, size in boxes)
        seen["whole trailing"] += any(len(shape) > 1 and size[-1] == shape[-1] > 0 and 0 not in size
                                      for _, size in boxes)
        masks = [element_mask([box], shape) for box in boxes]
        seen["overlap"] += any((a & b).any().item() for i, a in enumerate(masks) for b in masks[i + 1:])
        seen["merged"] += len(runs[0]) < sum(len(byte_runs([box], shape, itemsize, name="w")[0]) for box in boxes)
    assert all(seen.values()), seen


def test_byte_runs_by_hand() -> None:
    # a block of rows: one run
    assert byte_runs([((1, 0), (2, 4))], (4, 4), 2, name="w") == ([8], [24])
    # a block of columns: one run per row
    assert byte_runs([((0, 1), (3, 2))], (3, 4), 1, name="w") == ([1, 5, 9], [3, 7, 11])
    # two boxes that touch merge; a scalar is its one element; nothing selects nothing
    assert byte_runs([((0,), (2,)), ((2,), (3,))], (8,), 4, name="w") == ([0], [20])
    assert byte_runs([((), ())], (), 4, name="w") == ([0], [4])
    assert byte_runs([((1, 0), (0, 3))], (2, 3), 1, name="w") == ([], [])
    assert byte_runs([], (2, 3), 1, name="w") == ([], [])
    # a box that spans its trailing dimensions whole: one run per index of the leading one
    assert byte_runs([((0, 1, 0, 0), (2, 1, 2, 3))], (2, 2, 2, 3), 1, name="w") == ([6, 18], [12, 24])


def test_byte_runs_reject_a_box_that_does_not_fit() -> None:
    for box in [((0, 3), (2, 2)), ((0,), (2,)), ((0, 0, 0), (1, 1, 1)), ((2, 0), (1, 5))]:
        with pytest.raises(ConfigError, match=re.escape("'q_proj.weight'")):
            byte_runs([((0, 0), (1, 1)), box], (2, 4), 2, name="q_proj.weight")
    assert byte_runs([((0, 2), (2, 2))], (2, 4), 2, name="q_proj.weight") == ([4, 12], [8, 16])  # control


# --- part sums ---------------------------------------------------------------------------------------------------


def test_part_sums_do_not_depend_on_the_pieces() -> None:
    seen = {"scalar": 0, "zero-size": 0, "whole": 0, "nothing": 0, "boxes": 0, "cut": 0}
    for seed in range(12):
        rng = random.Random(seed)
        stream, part = random_stream(rng, torch.Generator().manual_seed(seed), 8)
        plan = PartPlan.of(part, 0)
        whole = fold_stream(plan, stream)
        masks = {name: selected_bytes(part, name, tensor) for name, tensor in stream}
        held = [name for name, _ in stream if part.regions(name) is None or masks[name].any()]
        assert whole.names == held, seed
        assert len(whole.sums()) == SUM_BYTES * len(held)
        assert whole.nbytes == sum(int(mask.sum()) for mask in masks.values()), seed
        for _ in range(5):
            pieces = fold_stream(plan, stream, rng)
            assert (pieces.sums(), pieces.names, pieces.nbytes) == (whole.sums(), whole.names, whole.nbytes), seed
            buckets = fold_buckets(plan, stream, rng)
            assert (buckets.sums(), buckets.names, buckets.nbytes) == (whole.sums(), whole.names, whole.nbytes), seed
        for name, tensor in stream:
            regions = part.regions(name)
            seen["scalar"] += tensor.dim() == 0
            seen["zero-size"] += tensor.numel() == 0
            seen["whole" if regions is None else "boxes" if regions else "nothing"] += 1
            seen["cut"] += bool(regions) and 0 < int(masks[name].sum()) < len(masks[name])
    assert all(seen.values()), seen


def test_part_sums_fold_nothing_of_an_empty_part_and_all_of_an_absent_tensor() -> None:
    generator = torch.Generator().manual_seed(7)
    stream: Stream = [("a", random_tensor(generator, (4, 3), torch.float32)),
                      ("b", random_tensor(generator, (5,), torch.bfloat16)),
                      ("c", random_tensor(generator, (), torch.uint8)),
                      ("z", random_tensor(generator, (0, 3), torch.float32))]
    sums = fold_stream(PartPlan.of(Part(tensors={"a": ()}), 0), stream)
    assert sums.names == ["b", "c", "z"]
    assert sums.nbytes == 10 + 1
    everything = fold_stream(PartPlan.of(Part(), 0), stream)
    assert everything.names == ["a", "b", "c", "z"]
    assert everything.nbytes == 48 + 10 + 1
    assert everything.sums()[SUM_BYTES:] == sums.sums()  # b, c and z hashed alike in both
    assert fold_buckets(PartPlan.of(Part(), 0), stream, random.Random(1)).sums() == everything.sums()
    nothing = fold_stream(PartPlan.of(Part(tensors={"a": (), "b": (), "c": (), "z": ()}), 0), stream)
    assert (nothing.names, nothing.nbytes, nothing.sums()) == ([], 0, b"")


def changed(tensor: torch.Tensor, at: int) -> torch.Tensor:
    """A copy of ``tensor`` with its byte ``at`` changed."""
    copy = tensor.clone()
    data = as_byte_view(copy)
    data[at] = (int(data[at]) + 1) % 256
    return copy


@pytest.mark.parametrize("seed", range(4))
def test_a_changed_byte_inside_the_part_is_named(seed: int) -> None:
    rng = random.Random(100 + seed)
    generator = torch.Generator().manual_seed(seed)
    stream, part = random_stream(rng, generator, 6)
    plan = PartPlan.of(part, 1)
    expected = [b"other part", fold_stream(plan, stream).sums()]
    check_sums(fold_stream(plan, stream, rng), expected, receiver=3, peer="actor 0")  # control: equal
    tried = 0
    for index, (name, tensor) in enumerate(stream):
        mask = selected_bytes(part, name, tensor)
        inside = torch.nonzero(mask).flatten().tolist()
        outside = torch.nonzero(~mask).flatten().tolist()
        for at in rng.sample(outside, min(3, len(outside))):  # negative control: bytes the part does not hold
            received = [*stream[:index], (name, changed(tensor, at)), *stream[index + 1:]]
            assert fold_stream(plan, received, rng).sums() == expected[1]
            check_sums(fold_stream(plan, received, rng), expected, receiver=3, peer="actor 0")
        for at in rng.sample(inside, min(3, len(inside))):
            received = [*stream[:index], (name, changed(tensor, at)), *stream[index + 1:]]
            assert fold_stream(plan, received, rng).sums() != expected[1]
            with pytest.raises(PartMismatchError, match="actor 0") as caught:
                check_sums(fold_stream(plan, received, rng), expected, receiver=3, peer="actor 0")
            assert (caught.value.tensor, caught.value.receiver) == (name, 3)
            tried += 1
    assert tried, "no tensor of the part held a byte: the test checked nothing"


def test_a_scrambled_outside_leaves_the_sums_alone() -> None:
    rng = random.Random(5)
    generator = torch.Generator().manual_seed(5)
    stream, part = random_stream(rng, generator, 10)
    plan = PartPlan.of(part, 0)
    received: Stream = []
    for name, tensor in stream:
        copy = tensor.clone()
        data = as_byte_view(copy)
        noise = torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=generator)
        data.copy_(torch.where(selected_bytes(part, name, tensor), data, noise))
        received.append((name, copy))
    assert any(not torch.equal(as_byte_view(a), as_byte_view(b)) for (_, a), (_, b) in zip(stream, received))
    assert fold_stream(plan, received, rng).sums() == fold_stream(plan, stream).sums()


def test_check_sums_on_fewer_tensors_and_a_foreign_index() -> None:
    generator = torch.Generator().manual_seed(3)
    stream: Stream = [(f"t{index}", random_tensor(generator, (3, 4), torch.float32)) for index in range(3)]
    plan = PartPlan.of(Part.split({"t1": (3, 4)}, dims={"t1": 1}, rank=0, parts=2), 0)
    expected = [fold_stream(plan, stream).sums()]
    check_sums(fold_stream(plan, stream), expected, receiver=1, peer="actor 0")  # control
    with pytest.raises(PartMismatchError, match="received 2 tensors of its part where actor 0 sent 3") as caught:
        check_sums(fold_stream(plan, stream[:2]), expected, receiver=1, peer="actor 0")
    assert (caught.value.tensor, caught.value.receiver) == ("", 1)
    foreign = PartSums(PartPlan(index=1, tensors=plan.tensors))
    foreign.fold_all([], 0)
    with pytest.raises(PartMismatchError, match="holds part 1, but actor 0 sent the sums of 1 parts") as caught:
        check_sums(foreign, expected, receiver=2, peer="actor 0")
    assert (caught.value.tensor, caught.value.receiver) == ("", 2)
    with pytest.raises(PartMismatchError, match="holds part 0"):
        check_sums(fold_stream(plan, stream), [], receiver=2, peer="actor 0")


def test_a_receiver_missing_a_middle_tensor_is_told_it_got_fewer() -> None:
    generator = torch.Generator().manual_seed(4)
    stream: Stream = [(f"t{index}", random_tensor(generator, (3, 4), torch.float32)) for index in range(3)]
    plan = PartPlan.of(Part(), 0)
    with pytest.raises(PartMismatchError) as caught:
        check_sums(fold_stream(plan, [stream[0], stream[2]]), [fold_stream(plan, stream).sums()], receiver=1,
                   peer="actor 0")
    assert caught.value.tensor in ("", "t1")  # got: 't2'


# --- Region and Part ---------------------------------------------------------------------------------------------


def test_region_narrow_and_whole() -> None:
    assert Region.narrow((4, 6), 1, 2, 3) == Region(start=(0, 2), size=(4, 3))
    assert Region.narrow((4, 6), 0, 4, 0) == Region(start=(4, 0), size=(0, 6))
    assert Region.whole((4, 6)) == Region(start=(0, 0), size=(4, 6))
    assert Region.whole(()) == Region(start=(), size=())
    assert Region(start=(0, 2), size=(4, 3)).fits((4, 5))
    assert not Region(start=(0, 2), size=(4, 3)).fits((4, 4))
    assert not Region(start=(0, 2), size=(4, 3)).fits((4, 5, 1))
    for dim, start, length in [(2, 0, 1), (-1, 0, 1), (1, 4, 3), (0, -1, 2), (0, 0, -1), (0, 0, 5)]:
        with pytest.raises(ConfigError, match=re.escape(f"narrow({dim}, {start}, {length})")):
            Region.narrow((4, 6), dim, start, length)


@pytest.mark.parametrize(("start", "size", "match"), [
    ((0, -1), (1, 1), "integers >= 0"),
    ((0, 0), (1, -2), "integers >= 0"),
    ((0, 0), (1,), "differ in rank"),
    ((0,), (), "differ in rank"),
    ((0, 1.5), (1, 1), "integers >= 0"),
])
def test_region_rejects_a_bad_box(start: tuple[int, ...], size: tuple[int, ...], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Region(start=start, size=size)


def test_part_round_trips_through_a_dict() -> None:
    part = Part(tensors={"q": (Region.narrow((8, 4), 0, 4, 4),), "none": (),
                         "cols": (Region(start=(0, 1), size=(3, 1)), Region(start=(1, 0), size=(1, 4))),
                         "scalar": (Region.whole(()),)},
                fallbacks=("embed",))
    data = part.to_dict()
    assert Part.from_dict(data) == part
    assert Part.from_dict(msgspec.json.decode(msgspec.json.encode(data))) == part  # through JSON: lists, not tuples
    assert Part.from_dict({}) == Part()


@pytest.mark.parametrize("tensors", [
    {"q_proj": [[[0], [1], [2]]]},
    {"q_proj": [[0, 1]]},
    {"q_proj": 5},
    {"q_proj": [[[0, 0], [1]]]},
    {"q_proj": [[[0, -1], [1, 1]]]},
    {"q_proj": [[["0"], [1]]]},
])
def test_part_from_dict_names_the_malformed_tensor(tensors: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=re.escape("'q_proj'")):
        Part.from_dict({"tensors": {"ok": [[[0], [1]]], **tensors}})


@pytest.mark.parametrize("data", [[], {"tensors": [1]}, {"tensors": None}, {"fallbacks": "embed"}, {"fallbacks": 3}])
def test_part_from_dict_rejects_a_malformed_part(data: object) -> None:
    with pytest.raises(ConfigError, match="part"):
        Part.from_dict(data)  # type: ignore[arg-type]


def test_part_split() -> None:
    shapes = {"rows": (6, 4), "cols": (4, 6), "norm": (4,)}
    split = [Part.split(shapes, dims={"rows": 0, "cols": 1}, rank=rank, parts=3) for rank in range(3)]
    assert split[1].regions("rows") == (Region(start=(2, 0), size=(2, 4)),)
    assert split[2].regions("cols") == (Region(start=(0, 4), size=(4, 2)),)
    assert split[0].regions("norm") is None
    for name in ("rows", "cols"):  # the ranks' regions tile each split tensor exactly once
        counts = sum(element_mask([(region.start, region.size) for region in part.tensors[name]], shapes[name]).int()
                     for part in split)
        assert isinstance(counts, torch.Tensor) and bool((counts == 1).all())
    indivisible = "'rows' of shape (6, 4) cannot be split 4 ways along dimension 0"
    with pytest.raises(ConfigError, match=re.escape(indivisible)):
        Part.split(shapes, dims={"rows": 0}, rank=0, parts=4)
    with pytest.raises(ConfigError, match=re.escape("'norm'")):
        Part.split(shapes, dims={"norm": 1}, rank=0, parts=2)
    for rank, parts in [(3, 3), (-1, 3), (0, 0)]:
        with pytest.raises(ConfigError, match=f"rank {rank} is not one of {parts} parts"):
            Part.split(shapes, dims={"rows": 0}, rank=rank, parts=parts)


# --- setup: declared parts ---------------------------------------------------------------------------------------


def tp_part(rank: int) -> Part:
    return Part.split({"q": (4, 8), "o": (8, 4)}, dims={"q": 0, "o": 1}, rank=rank, parts=2)


def test_equal_parts_share_an_index() -> None:
    reordered = tp_part(0).to_dict()
    reordered["tensors"] = dict(reversed(list(reordered["tensors"].items())))
    rollout: list[WorkerMetadata] = [{PART_KEY: tp_part(0).to_dict(), "port": 1}, {PART_KEY: reordered},
                                     {PART_KEY: tp_part(1).to_dict()}, {"port": 4}, {PART_KEY: tp_part(1).to_dict()}]
    plans = declared_parts(rollout, [f"rollout {rank}" for rank in range(5)])
    assert [None if plan is None else plan.index for plan in plans] == [0, 0, 1, None, 1]
    assert plans[0] == PartPlan.of(tp_part(0), 0)
    assert plans[2] == PartPlan.of(tp_part(1), 1)
    assert declared_parts([{}, {"port": 2}], ["rollout 0", "rollout 1"]) == [None, None]


@pytest.mark.parametrize("declared", [
    "half", 3, [1, 2], {"tensors": [["q"]]}, {"tensors": {"q": [[[0], [-1]]]}}, {"fallbacks": "q"},
])
def test_a_malformed_declared_part_names_the_worker(declared: object) -> None:
    rollout: list[WorkerMetadata] = [{PART_KEY: tp_part(0).to_dict()}, {PART_KEY: declared}]  # type: ignore[dict-item]
    with pytest.raises(TopologyError, match="replica 0 worker 1: malformed part") as caught:
        declared_parts(rollout, ["replica 0 worker 0", "replica 0 worker 1"])
    assert caught.value.details["field"] == "$.part"


def test_with_declared_parts_hands_out_the_plan() -> None:
    rollout: list[WorkerMetadata] = [{PART_KEY: tp_part(0).to_dict()}, {PART_KEY: tp_part(1).to_dict()}, {},
                                     {PART_KEY: tp_part(0).to_dict()}]
    parts = declared_parts(rollout, [f"rollout {rank}" for rank in range(4)])
    actor_args: list[RankArgs] = [{"rank": 0}, {"rank": 1}]
    rollout_args: list[RankArgs] = [{"rank": rank} for rank in range(4)]
    with_declared_parts(actor_args, rollout_args, parts)
    distinct = [PartPlan.of(tp_part(0), 0), PartPlan.of(tp_part(1), 1)]
    for rank, args in enumerate(actor_args):
        assert args["rank"] == rank and "part" not in args
        assert msgspec.convert(args["parts"], list[PartPlan]) == distinct
    assert [args["rank"] for args in rollout_args] == [0, 1, 2, 3]
    assert ["part" in args for args in rollout_args] == [True, True, False, True]
    assert all("parts" not in args for args in rollout_args)
    for args, expected in zip(rollout_args, parts):
        if expected is not None:
            assert msgspec.convert(args["part"], PartPlan) == expected
    # control: nobody declared a part, nobody's args change
    actor_args, rollout_args = [{"rank": 0}], [{"rank": 0}, {"rank": 1}]
    with_declared_parts(actor_args, rollout_args, [None, None])
    assert (actor_args, rollout_args) == ([{"rank": 0}], [{"rank": 0}, {"rank": 1}])


def test_malformed_boxes_and_splits_are_config_errors_naming_the_tensor() -> None:
    with pytest.raises(ConfigError, match="'w'"):
        byte_runs([((-1,), (2,))], (4,), 1, name="w")
    with pytest.raises(ConfigError, match="'w'"):
        byte_runs([((0, 0), (2,))], (4,), 1, name="w")
    with pytest.raises(ConfigError, match="'b'"):
        Part.split({"a": (4,)}, dims={"b": 0}, rank=0, parts=2)
    with pytest.raises(ConfigError):
        Region(start=(True,), size=(True,))


def test_gathered_and_direct_runs_hash_the_selected_bytes_in_row_major_order() -> None:
    """A block of columns of a large tensor (rows of 2 KiB: gathered, 256 KiB per native copy, several groups per
    piece) next to a block of rows (one long run: hashed where it lies), folded in uneven pieces: each tensor's sum is
    XXH3-64 of its name, dtype and shape, then exactly its selected bytes in row-major order."""
    import xxhash

    from weightsync.core.wire.parts import DIRECT_BYTES, GATHER_BYTES, PartLayout, PartSums

    shape = (1024, 2048)  # bytes per row: 4096 (bfloat16)
    columns = Region.narrow(shape, 1, 1024, 1024)  # 2 KiB of each row
    rows = Region.narrow(shape, 0, 256, 512)  # one 2 MiB run
    plan = PartPlan.of(Part(tensors={"a": (columns,), "b": (rows,)}), 0)
    generator = torch.Generator().manual_seed(9)
    tensors = {name: torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=generator)
               .view(torch.bfloat16) for name in ("a", "b")}
    assert 2048 < DIRECT_BYTES and 2 * 1024 * 512 > DIRECT_BYTES and 1024 * 2048 > 3 * GATHER_BYTES
    layout = PartLayout(plan)
    for cuts in ((0, 1 << 22), (0, 700_001, 2_300_000, 1 << 22)):
        sums = PartSums(layout)
        for name, tensor in tensors.items():
            data = tensor.contiguous().view(torch.uint8).reshape(-1)
            for low, high in zip(cuts, cuts[1:]):
                meta = TensorMeta(name, "bfloat16", shape, low, high - low, 1 << 22, 0)
                sums.fold(meta, data.data_ptr() + low)
        expected = b""
        for name, region in (("a", columns), ("b", rows)):
            selected = tensors[name][tuple(slice(s, s + n) for s, n in zip(region.start, region.size))]
            digest = xxhash.xxh3_64(f"{name}\0bfloat16\0{shape}".encode())
            kept = as_byte_view(selected.contiguous())  # alive while its bytes are read
            digest.update(bytes(memoryview_of(kept)))
            expected += digest.intdigest().to_bytes(8, "little")
        assert sums.sums() == expected, cuts


@pytest.mark.parametrize("seed", range(3))
def test_copies_land_exactly_the_part_in_a_full_shape_destination_and_in_a_shard(seed: int) -> None:
    """``PartLayout.copies`` of a piece, applied by the native copy the reader uses: into a full-shape destination
    it writes exactly the box's bytes where they lie (the rest untouched); into a shard (the box's shape) the box in
    row-major order, each group contiguous there — whatever the pieces the tensor was cut into. Small tensors with
    random boxes, and one large enough for groups and long runs cut at ``GATHER_BYTES``."""
    from weightsync.core.native import copy_batch
    from weightsync.core.wire.parts import GATHER_BYTES, PartLayout

    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    cases: list[tuple[torch.Tensor, Box]] = []
    while len(cases) < 40:
        shape = random_shape(rng)
        cases.append((random_tensor(generator, shape, DTYPE_OF_ITEMSIZE[rng.choice((1, 2, 4))]),
                      random_box(rng, shape)))
    large = random_tensor(generator, (640, 1024), torch.bfloat16)  # rows of 2 KiB; 1.25 MiB
    cases += [(large, ((0, 100), (640, 700))), (large, ((100, 0), (400, 1024)))]
    for index, (tensor, box) in enumerate(cases):
        name = f"t{index}"
        layout = PartLayout(PartPlan(index=0, tensors={name: [box]}))
        data = as_byte_view(tensor)
        full = torch.zeros_like(data)
        shard = torch.zeros(math.prod(box[1]) * tensor.element_size(), dtype=torch.uint8)
        cuts = cut_points(rng, data.numel())
        spans: list[tuple[int, int]] = []
        for low, high in zip(cuts, cuts[1:]):
            meta = meta_of(name, tensor, low, high)
            runs = layout.runs_of(meta)
            assert runs is not None
            for group in layout.copies(meta, runs, compact=False):
                copy_batch(group.triples, full.data_ptr(), data.data_ptr() + low)
            for group in layout.copies(meta, runs, compact=True):
                assert sum(group.triples[2::3]) == group.nbytes
                assert list(group.triples[0::3]) == sorted(group.triples[0::3])
                copy_batch(group.triples, shard.data_ptr(), data.data_ptr() + low)
                spans.append((group.start, group.nbytes))
        mask = byte_mask([box], tensor.shape, tensor.element_size())
        assert torch.equal(full[mask], data[mask]) and not full[~mask].any(), (index, box)
        selected = tensor[tuple(slice(s, s + n) for s, n in zip(*box))].contiguous()
        assert torch.equal(shard, as_byte_view(selected).reshape(-1)), (index, box)
        at = 0  # the groups tile the shard in order
        for start, nbytes in spans:
            assert start == at and (nbytes <= 2 * GATHER_BYTES), (index, spans)
            at += nbytes
        assert at == shard.numel()


@pytest.mark.parametrize("seed", range(3))
def test_the_senders_parts_digest_folds_while_packing_what_a_reader_folds_from_the_bucket(seed: int) -> None:
    """``PartsDigest`` fed by ``pack_hashing`` (the sender's pack: small pieces from the bucket, large ones from
    their sources, padding between) gives each part the sums a reader folds from the packed bucket (``fold_all``);
    with ``whole`` its whole digest is a plain digest's, without it the digest is the parts' sums' and no whole
    digest is computed. Random tensors (empty ones included) and a large one split across buckets."""
    from weightsync.core.pipeline.planner import plan_buckets
    from weightsync.core.wire.digest import UpdateDigest
    from weightsync.core.wire.layout import pack_hashing
    from weightsync.core.wire.parts import PartsDigest

    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    stream, part = random_stream(rng, generator, 30)
    stream.insert(rng.randint(0, len(stream)), ("large", random_tensor(generator, (700, 1024), torch.bfloat16)))
    plans = [PartPlan.of(part, 0), PartPlan.of(Part(tensors={"large": (Region.narrow((700, 1024), 1, 0, 512),)}), 1)]
    for whole in (True, False):
        folding, reference = PartsDigest([PartSums(plan) for plan in plans], whole=whole), UpdateDigest()
        read = [PartSums(plan) for plan in plans]
        for bucket in plan_buckets(stream, bucket_bytes=600_000, devices=frozenset({"cpu"})):
            metas = [item[0] for item in bucket.items]
            buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            folding.pieces(metas)
            folding.begin_bucket(b"table", bucket.nbytes)
            pack_hashing(buffer.data_ptr(), bucket, folding)
            reference.update_bucket(b"table", buffer)
            for sums in read:
                sums.fold_all(metas, buffer.data_ptr())
        assert [sums.sums() for sums in folding.parts] == [sums.sums() for sums in read], whole
        assert [sums.names for sums in folding.parts] == [sums.names for sums in read]
        assert (folding.hexdigest() == reference.hexdigest()) is whole
        assert whole or folding.hexdigest().startswith("parts-")


def test_part_groups_by_what_each_host_holds() -> None:
    """Hosts whose workers hold half the layers each skip the other half's tensors and form two groups; hosts of
    tensor-parallel halves (each host one rank's halves) form two groups, each carrying its rank's boxes; hosts that
    each hold both halves need the same (one group, today's delivery); a worker without a part makes its host hold
    the whole model."""
    from weightsync.core.wire.partplans import held_by_host, part_groups

    def held(part: PartPlan) -> dict[str, list[Box]]:
        return part.tensors

    first, second = (PartPlan.of(Part(tensors={name: () for name in names}), index)
                     for index, names in enumerate((("b", "c"), ("a",))))
    groups = part_groups([first, first, second, second], ["h1", "h1", "h2", "h2"])
    assert [(held(part), hosts) for part, hosts in groups] == [({"b": [], "c": []}, ["h1"]), ({"a": []}, ["h2"])]
    halves = [PartPlan.of(tp_part(rank), rank) for rank in (0, 1)]
    by_rank = part_groups([halves[0], halves[0], halves[1], halves[1]], ["h1", "h1", "h2", "h2"])
    assert [(held(part), hosts) for part, hosts in by_rank] == [(halves[0].tensors, ["h1"]),
                                                                (halves[1].tensors, ["h2"])]
    assert [part.index for part, _ in by_rank] == [-1, -1]
    assert {host: held(part) for host, part in held_by_host([first, None, second], ["h1", "h1", "h2"]).items()} == {
        "h1": {}, "h2": {"a": []}}
    both = part_groups(halves * 2, ["h1", "h1", "h2", "h2"])  # each host holds both halves of every tensor
    assert [hosts for _, hosts in both] == [["h1", "h2"]]
    assert held_by_host(halves * 2, ["h1"] * 4)["h1"].tensors == {
        name: [*halves[0].tensors[name], *halves[1].tensors[name]] for name in halves[0].tensors}
    assert held_by_host([halves[0], None], ["h1", "h1"])["h1"].tensors == {}


def test_grouped_topology_gives_each_group_of_hosts_a_sender_and_a_chain_of_its_own() -> None:
    """Hosts h1 and h2 each hold half the layers (two workers each): two groups, each with its own sender
    (actor ranks 0 and 1 on the sender's host), which skips the other half's tensors, and a two-level chain over its
    host alone (its first worker reads over the network, the second in place)."""
    from weightsync.api.types import WorldMetadata
    from weightsync.core.transports.chain.groups import grouped_topology
    from weightsync.core.transports.chain.plan import ChainReceive, ChainSend
    from weightsync.core.transports.plan import decode_plan

    def worker(node: str, address: str, part: Part | None = None) -> WorkerMetadata:
        entry: WorkerMetadata = {"node_id": node, "address": address, "library": "tcp"}
        if part is not None:
            entry[PART_KEY] = part.to_dict()
        return entry

    first, second = Part(tensors={"b": (), "c": ()}), Part(tensors={"a": ()})
    leader = {**worker("h0", "h0:1"), "layout": "two_level"}  # actor rank 0 says the layout
    metadata = WorldMetadata(actor=[leader, worker("h0", "h0:2")],
                             rollout=[worker("h1", "h1:1", first), worker("h1", "h1:2", first),
                                      worker("h2", "h2:1", second), worker("h2", "h2:2", second)])
    topology = grouped_topology("tcp", metadata, fanout=1, addresses=["h1:1", "h1:2", "h2:1", "h2:2"])
    assert topology is not None and topology.senders == (0, 1)
    senders = [decode_plan(args, ChainSend, who="actor") for args in topology.actor]
    assert [sender.skip for sender in senders] == [("b", "c"), ("a",)]
    assert [sender.children for sender in senders] == [(1,), (3,)]
    receivers = [decode_plan(args, ChainReceive, who="rollout") for args in topology.rollout]
    assert [receiver.sender for receiver in receivers] == [0, 0, 1, 1]
    assert [(r.source.upstream, r.source.local) for r in receivers] == [
        ("h0:1", False), ("h1:1", True), ("h0:2", False), ("h2:1", True)]
    assert [sender.carry for sender in senders] == [{}, {}]
    # Tensor parallelism over hosts (h1 holds rank 0's halves, h2 rank 1's): each group's sender carries its boxes.
    by_rank = WorldMetadata(actor=metadata.actor, rollout=[worker(f"h{i // 2 + 1}", f"x:{i}", tp_part(i // 2))
                                                           for i in range(4)])
    topology = grouped_topology("tcp", by_rank, fanout=1, addresses=["x"] * 4)
    assert topology is not None and topology.senders == (0, 1)
    senders = [decode_plan(args, ChainSend, who="actor") for args in topology.actor]
    assert [sender.carry for sender in senders] == [PartPlan.of(tp_part(rank), 0).tensors for rank in (0, 1)]
    assert [sender.skip for sender in senders] == [(), ()]
    # One group (every host holds both halves of every tensor), or too few actor ranks: no grouped topology.
    halves = WorldMetadata(actor=metadata.actor, rollout=[worker(f"h{i // 2 + 1}", f"x:{i}", tp_part(i % 2))
                                                          for i in range(4)])
    assert grouped_topology("tcp", halves, fanout=1, addresses=["x"] * 4) is None
    alone = WorldMetadata(actor=metadata.actor[:1], rollout=metadata.rollout)
    assert grouped_topology("tcp", alone, fanout=1, addresses=["x"] * 4) is None
    chain = WorldMetadata(actor=[{**leader, "layout": "chain"}, *metadata.actor[1:]], rollout=metadata.rollout)
    assert grouped_topology("tcp", chain, fanout=1, addresses=["x"] * 4) is None  # the groups are by host
    malformed = WorldMetadata(actor=metadata.actor, rollout=[*metadata.rollout[:3], {**metadata.rollout[3],
                                                                                     PART_KEY: {"tensors": 5}}])
    with pytest.raises(TopologyError, match="rollout rank 3: malformed part"):
        grouped_topology("tcp", malformed, fanout=1, addresses=["x"] * 4)


def test_part_groups_share_out_the_rails_each_dealing_its_stream_into_stripes() -> None:
    """Rails and parts together: hosts h1 and h2 each hold half the layers, every host has a worker on each of 4
    rails and actor rank 0 asks for 4 stripes. Each group takes 2 rails of its own (h1's group rails 0 and 1, h2's 2
    and 3) and deals its stream into 2 stripes, each from the sender's actor rank on that rail, skipping the other
    half's tensors; each host's workers read only their group's stripes, over those rails. The manager checks each
    receiver against its own group's stripes combined. Staged, each host's stagers are its workers on its group's
    rails. With 2 rails each group is one stream over a rail of its own."""
    from weightsync.api.types import Topology, TransferReport, WorldMetadata
    from weightsync.core.control.parts import members_metadata
    from weightsync.core.control.round import Round
    from weightsync.core.control.staged import StagedPlan
    from weightsync.core.transports.chain.groups import grouped_topology
    from weightsync.core.transports.chain.plan import ChainReceive, ChainSend, StripesReceive
    from weightsync.core.transports.plan import decode_plan
    from weightsync.core.wire.digest import combine_stripes

    def world(rails: int, **options: object) -> WorldMetadata:
        def worker(node: str, rail: int, part: Part | None = None) -> WorkerMetadata:
            entry: WorkerMetadata = {"node_id": node, "address": f"{node}:{rail}", "library": "tcp", "rail": rail}
            return {**entry, PART_KEY: part.to_dict()} if part is not None else entry

        halves = {"h1": Part(tensors={"b": (), "c": ()}), "h2": Part(tensors={"a": ()})}
        actor = [worker("h0", rail) for rail in range(rails)]
        actor[0] = {**actor[0], "layout": "two_level", "stripes": rails, **options}  # type: ignore[dict-item]
        return WorldMetadata(actor=actor, rollout=[worker(host, rail, halves[host]) for host in ("h1", "h2")
                                                   for rail in range(rails)])

    def build(metadata: WorldMetadata) -> Topology | None:
        return grouped_topology("tcp", metadata, fanout=1, addresses=[f"{w['node_id']}:{w['rail']}"
                                                                      for w in metadata.rollout])

    topology = build(world(4))
    assert topology is not None and (topology.stripes, topology.groups) == (2, 2)
    topology.check(actor_wg_world_size=4, rollout_world_size=8)
    assert topology.stripe_groups == ((0, 1), (2, 3))
    senders = [decode_plan(args, ChainSend, who="actor") for args in topology.actor]
    assert [(s.striping, s.skip) for s in senders] == [((0, 2), ("b", "c")), ((1, 2), ("b", "c")),
                                                       ((0, 2), ("a",)), ((1, 2), ("a",))]
    receivers = [decode_plan(args, StripesReceive, who="rollout") for args in topology.rollout]
    assert [r.sender for r in receivers] == [0] * 4 + [2] * 4
    for rank, receiver in enumerate(receivers):
        assert [source.route.rail for source in receiver.sources if source.route] == ([0, 1] if rank < 4 else [2, 3])
        over = [source.upstream for source in receiver.sources if not source.local]  # the stripe it leads
        assert over == ([f"h0:{rank % 4}"] if rank % 4 in ((0, 1) if rank < 4 else (2, 3)) else []), (rank, over)
    # The manager: each receiver against its group's stripes, combined in stripe order (a control: the other's).
    round_ = Round.of(1, [])
    round_.stripes = topology.stripe_groups
    round_.senders = [TransferReport(role="actor", rank=rank, version=1, nbytes=1, tensors=1, buckets=1, seconds=0.0,
                                     digest=f"{rank:032x}") for rank in range(4)]
    sent = round_.sent()
    assert sent[0] == sent[1] == combine_stripes([f"{0:032x}", f"{1:032x}"]) != sent[2] == sent[3]
    # Two rails, two groups: each group one stream over its sender's rail.
    two = build(world(2))
    assert two is not None and (two.senders, two.stripes, two.groups) == ((0, 1), 1, 1)
    chains = [decode_plan(args, ChainReceive, who="rollout") for args in two.rollout]
    assert [(c.sender, c.source.upstream) for c in chains if not c.source.local] == [(0, "h0:0"), (1, "h0:1")]
    # Staged: each host's stagers are its workers on its group's rails, one stripe each.
    full = world(4, staged=True)
    chosen = StagedPlan.of(full)
    assert chosen.stagers == {"h1": (0, 1), "h2": (6, 7)}
    # The topology as the manager builds it, from the stagers' metadata alone (each declaring its host's part).
    labels = [f"rollout rank {rank}" for rank in range(len(full.rollout))]
    stagers = build(WorldMetadata(actor=full.actor, rollout=members_metadata(full.rollout, chosen.members, labels)))
    assert stagers is not None and stagers.stripe_groups == ((0, 1), (2, 3))
    assert [decode_plan(args, ChainReceive, who="stager").striping for args in stagers.rollout] == [(0, 2), (1, 2)] * 2
    # h2 on rails 0 and 1 only: group 2 cannot have rails 2 and 3, so the stripes stay over rails 0 and 1, where
    # every host's stagers are; the topology built from them gives way to them (each stager a stripe).
    narrow = WorldMetadata(actor=full.actor, rollout=[entry for entry in full.rollout
                                                      if entry["node_id"] == "h1" or entry["rail"] in (0, 1)])
    chosen = StagedPlan.of(narrow)
    assert chosen.stagers == {"h1": (0, 1), "h2": (4, 5)}
    assert build(WorldMetadata(actor=full.actor, rollout=members_metadata(narrow.rollout, chosen.members,
                                                                          labels[:6]))) is None
    assert StagedPlan.of(world(4)).stagers == {"h1": (0, 1), "h2": (6, 7)}
    assert build(world(4, stripes=1)) is not None  # no stripes asked: a stream per group
    with pytest.raises(TopologyError, match="one sender per stripe"):
        Topology(actor=topology.actor, rollout=topology.rollout, senders=(0, 1, 2), stripes=2, groups=2).check(
            actor_wg_world_size=4, rollout_world_size=8)


def test_a_part_group_s_stream_lost_on_its_rail_names_it_and_no_group_goes_over_it_until_it_is_back() -> None:
    """A part group's stream over rail 1 (each host its half, one rail each) fails: the receiver's error names rail
    1 and both hosts (``OnRail``), so the manager records the rail as lost; ``auto`` then puts it in ``left_out``
    (delta updates too, which deal no stripes), and no group is dealt over it: with 4 rails the groups take rails 0
    and 2; with 2 rails and one actor rank on rail 0 one stream over rail 0 serves both hosts (no grouped topology);
    with two actor ranks on rail 0 each group gets one of them. A control: the same failure read in place (no
    route) is raised as it is."""
    from weightsync.api.types import Topology, WorldMetadata
    from weightsync.core.control.auto import choose
    from weightsync.core.control.rails import LostRails
    from weightsync.api.errors import TransferError
    from weightsync.core.transports.chain.groups import grouped_topology
    from weightsync.core.transports.chain.plan import ChainReceive
    from weightsync.core.transports.chain.stripes import OnRail
    from weightsync.core.transports.plan import decode_plan
    from weightsync.core.transports.seam import ReceivedBucket

    class Broken:
        capacity = 1

        def receive(self, deadline: float) -> ReceivedBucket:
            raise TransferError("connection reset", peer="actor rank 1 (rail 1 from host h0 to host h2)", closed=True)

        def release(self, token: int) -> None: ...

        def close(self) -> None: ...

    with pytest.raises(TransferError, match="stream over rail 1 from host h0 to host h2 failed") as caught:
        OnRail(Broken(), "stream", (1, ["h0", "h2"])).receive(0.0)
    assert (caught.value.rail, caught.value.hosts, caught.value.closed) == (1, ["h0", "h2"], True)
    lost = LostRails()
    lost.record(caught.value)
    assert lost.rails == {1}
    with pytest.raises(TransferError, match="^connection reset$"):
        OnRail(Broken(), "stream", None).receive(0.0)

    for striping in (True, False):  # auto leaves the rail out of the stripes and of the groups, delta or not
        choice = choose(sender_node="h0", rollout_nodes=["h1", "h1", "h2", "h2"], available=lambda: ["tcp"],
                        sender_rails=[0, 1], rollout_rails=[0, 1, 0, 1], lost_rails=lost.rails, striping=striping)
        assert choice.options == {"layout": "two_level", "left_out": [1]} and "rail 1 left out" in choice.reason

    def build(actor_rails: list[int], rails: int, **options: object) -> Topology | None:
        halves = {"h1": Part(tensors={"b": ()}), "h2": Part(tensors={"a": ()})}
        actor: list[WorkerMetadata] = [{"node_id": "h0", "address": f"h0:{i}", "library": "tcp", "rail": rail}
                                       for i, rail in enumerate(actor_rails)]
        actor[0] = {**actor[0], "layout": "two_level", **options}  # type: ignore[dict-item]
        rollout: list[WorkerMetadata] = [{"node_id": host, "address": f"{host}:{rail}", "library": "tcp", "rail": rail,
                                          PART_KEY: halves[host].to_dict()} for host in ("h1", "h2")
                                         for rail in range(rails)]
        return grouped_topology("tcp", WorldMetadata(actor=actor, rollout=rollout), fanout=1,
                                addresses=[f"{w['node_id']}:{w['rail']}" for w in rollout])

    def rails_of(topology: Topology | None) -> list[int]:
        """The rail of each chain read over the network (each host's leader's)."""
        assert topology is not None
        chains = [decode_plan(args, ChainReceive, who="rollout") for args in topology.rollout]
        return [chain.source.route.rail for chain in chains if chain.source.route and not chain.source.local]

    assert rails_of(build([0, 1], 2)) == [0, 1]  # the control: each group over a rail of its own
    assert build([0, 1], 2, left_out=[1]) is None  # one sender on rail 0: one stream serves both hosts
    assert rails_of(build([0, 0, 1], 2, left_out=[1])) == [0, 0]  # two senders on rail 0: a group each
    assert rails_of(build([0, 1, 2, 3], 4, stripes=[0, 2, 3], left_out=[1])) == [0, 2]


def test_a_stager_declares_what_its_hosts_workers_hold_together() -> None:
    """Staged: only each host's stager joins the transport's world, so the topology is built from the stagers'
    metadata with each declaring its host's union: on h1 one worker holds only ``a``,
    the other only ``b`` (the host skips ``c``); on h2 both hold ``b`` and ``c`` (it skips ``a``); on h3 a worker
    without a part (it skips nothing: no part). Each group's sender then skips what its hosts skip. Unstaged (every
    worker a member) the metadata is the workers' own."""
    from weightsync.api.types import WorldMetadata
    from weightsync.core.control.parts import members_metadata
    from weightsync.core.transports.chain.groups import grouped_topology
    from weightsync.core.transports.chain.plan import ChainSend
    from weightsync.core.transports.plan import decode_plan

    def worker(node: str, part: Part | None = None) -> WorkerMetadata:
        entry: WorkerMetadata = {"node_id": node, "address": f"{node}:1", "library": "tcp"}
        return {**entry, PART_KEY: part.to_dict()} if part is not None else entry

    rollout = [worker("h1", Part(tensors={"b": (), "c": ()})), worker("h1", Part(tensors={"a": (), "c": ()})),
               worker("h2", Part(tensors={"a": ()})), worker("h2", Part(tensors={"a": ()})), worker("h3"),
               worker("h3", Part(tensors={"a": ()}))]
    labels = [f"worker{i}" for i in range(len(rollout))]
    stagers = members_metadata(rollout, [0, 2, 4], labels)
    assert [entry.get(PART_KEY) for entry in stagers] == [
        Part(tensors={"c": ()}).to_dict(), Part(tensors={"a": ()}).to_dict(), None]
    assert [{k: v for k, v in entry.items() if k != PART_KEY} for entry in stagers] == [
        {k: v for k, v in rollout[i].items() if k != PART_KEY} for i in (0, 2, 4)]
    assert members_metadata(rollout, range(len(rollout)), labels) == rollout
    actor = [{**worker("h0"), "layout": "two_level", "staged": True}, worker("h0"), worker("h0")]
    topology = grouped_topology("tcp", WorldMetadata(actor=actor, rollout=stagers), fanout=1,
                                addresses=["h1:1", "h2:1", "h3:1"])
    assert topology is not None
    assert [decode_plan(args, ChainSend, who="actor").skip for args in topology.actor] == [("c",), ("a",), ()]
    # Tensor-parallel halves over hosts (h1's workers hold rank 0's, h2's rank 1's): each stager declares its
    # host's regions, and each group's sender carries them.
    halves = [worker(f"h{i // 2 + 1}", tp_part(i // 2)) for i in range(4)]
    stagers = members_metadata(halves, [0, 2], labels[:4])
    assert [entry[PART_KEY] for entry in stagers] == [tp_part(0).to_dict(), tp_part(1).to_dict()]
    topology = grouped_topology("tcp", WorldMetadata(actor=actor, rollout=stagers), fanout=1,
                                addresses=["h1:1", "h2:1"])
    assert topology is not None
    assert [decode_plan(args, ChainSend, who="actor").carry for args in topology.actor[:2]] == [
        PartPlan.of(tp_part(rank), 0).tensors for rank in (0, 1)]


def test_layouts_keep_what_was_found_for_the_same_regions_across_epochs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new epoch's plan with the same regions (another index) takes over the runs already found — counted by
    wrapping ``byte_runs`` — and folds the same sums as a fresh layout; other regions are found anew, and the least
    recently used layout goes when there are too many."""
    from weightsync.core.wire import parts as wire_parts
    from weightsync.core.worker.engine import PartLayouts

    calls: list[str] = []
    found = wire_parts.byte_runs

    def counted(boxes: Sequence[Box], shape: Sequence[int], itemsize: int, *, name: str) -> tuple[list[int], list[int]]:
        calls.append(name)
        return found(boxes, shape, itemsize, name=name)

    monkeypatch.setattr(wire_parts, "byte_runs", counted)
    tensor = torch.arange(64 * 32, dtype=torch.float32).to(torch.bfloat16).reshape(64, 32)
    meta = meta_of("w", tensor, 0, tensor.numel() * 2)
    columns, rows = Part(tensors={"w": (Region.narrow((64, 32), 1, 0, 16),)}), \
        Part(tensors={"w": (Region.narrow((64, 32), 0, 0, 32),)})

    def fold(layout: wire_parts.PartLayout) -> bytes:
        sums = PartSums(layout)
        sums.fold(meta, as_byte_view(tensor).data_ptr())
        return sums.sums()

    layouts = PartLayouts(most=2)
    first = fold(layouts.of(PartPlan.of(columns, 0)))
    again = layouts.of(PartPlan.of(columns, 3))
    assert again.plan.index == 3 and fold(again) == first == fold(wire_parts.PartLayout(PartPlan.of(columns, 0)))
    assert calls == ["w", "w"]  # the first epoch's, and the fresh layout's; none for the kept one
    fold(layouts.of(PartPlan.of(rows, 1)))
    fold(layouts.of(PartPlan.of(Part(), 2)))  # a third distinct part: the columns' layout is the oldest, and goes
    fold(layouts.of(PartPlan.of(columns, 0)))
    assert calls == ["w", "w", "w", "w"]
