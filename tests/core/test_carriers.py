"""Carriers (``weightsync.core.wire.carriers``): a stream that carries of each tensor only the span of its receivers'
regions — tensor parallelism split over hosts, each host taking in its rank's rows and its block of columns.

A real shm sender and receiver in this process, the sender planned as a part group's (``RankPlan.carry``: the
receiver's rank's regions; ``blocked``: the column-split tensors travel block after block, as for both ranks), the
receiver holding that rank's part. What arrives is checked against the tensors sent, element by element.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Iterator

import msgspec
import pytest
import torch

from weightsync.api.parts import Part
from weightsync.api.types import TransferReport, WorkerContext, WorldMetadata
from weightsync.core.transports.plan import with_parts
from weightsync.core.wire.blocks import candidates
from weightsync.core.wire.carriers import carried_span
from weightsync.core.wire.partplans import PartPlan
from weightsync.shm import ShmCheckpointEngine

from tests.workloads import filled

SHAPES = {"q": (64, 32), "o": (32, 64), "down": (32, 128), "norm": (32,), "experts": (4, 24, 16)}
DIMS = {"q": 0, "o": 1, "down": 1, "experts": 1}
BUCKET = 16 << 10  # q, o, down (8-16 KiB) each split across buckets where their span does not fit the open one


def boxes(rank: int) -> dict[str, tuple[slice, ...]]:
    """Rank ``rank``'s regions (of two), as index slices."""
    part = Part.split(SHAPES, dims=DIMS, rank=rank, parts=2)
    return {name: tuple(slice(start, start + size) for start, size in zip(region.start, region.size))
            for name, (region,) in part.tensors.items()}


class Pair:
    """A shm sender and one receiver in this process, planned as a part group's."""

    def __init__(self, rank: int, *, carry: bool, bucket: int = BUCKET) -> None:
        context = {role: WorkerContext(role=role, rank=0, node_id="host") for role in ("actor", "rollout")}
        self.sender = ShmCheckpointEngine(bucket_bytes=bucket, timeout=10.0, context=context["actor"])
        self.receiver = ShmCheckpointEngine(bucket_bytes=bucket, timeout=10.0, context=context["rollout"])
        metadata = WorldMetadata(actor=[self.sender.prepare()], rollout=[self.receiver.prepare()])
        topology = ShmCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata)
        plans = [PartPlan.of(Part.split(SHAPES, dims=DIMS, rank=each, parts=2), each) for each in (0, 1)]
        sender_args = with_parts(topology.actor[0], parts=plans, parts_only=True,
                                 blocked=candidates([plan.tensors for plan in plans]))
        if carry:
            sender_args = {**sender_args, "carry": msgspec.to_builtins(plans[rank].tensors)}
        receiver_args = with_parts(topology.rollout[0], part=plans[rank])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(self.sender.init_process_group, rank_args=sender_args),
                           pool.submit(self.receiver.init_process_group, rank_args=receiver_args)]:
                future.result()

    def views(self, sent: dict[str, torch.Tensor], addresses: dict[str, int] | None = None
              ) -> tuple[TransferReport, dict[str, torch.Tensor]]:
        """One update, each view the receiver yields copied as it comes (and the buffer it lay in, into
        ``addresses``)."""
        async def both() -> tuple[TransferReport, dict[str, torch.Tensor]]:
            sending = asyncio.ensure_future(self.sender.send_weights(list(sent.items())))
            seen = {}
            async for name, view in self.receiver.receive_weights():
                seen[name] = view.clone()
                if addresses is not None:
                    addresses[name] = view.untyped_storage().data_ptr()
            return await sending, seen

        return asyncio.run(both())

    def into(self, sent: dict[str, torch.Tensor], destinations: dict[str, torch.Tensor]) -> TransferReport:
        async def both() -> TransferReport:
            sending = asyncio.ensure_future(self.sender.send_weights(list(sent.items())))
            await self.receiver.receive_weights().copy_into(destinations)
            report: TransferReport = await sending
            return report

        return asyncio.run(both())

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture(params=[0, 1], ids=["rank0", "rank1"])
def rank(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def pair_of(rank: int, *, carry: bool = True, bucket: int = BUCKET) -> Iterator[Pair]:
    made = Pair(rank, carry=carry, bucket=bucket)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def pair(rank: int) -> Iterator[Pair]:
    yield from pair_of(rank)


def model(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in SHAPES.items()}


def part_bytes(rank: int) -> int:
    held = boxes(rank)
    return sum(math.prod(shape) * 2 // (2 if name in held else 1) for name, shape in SHAPES.items())


def check_views(seen: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], rank: int) -> None:
    """Each view holds the rank's region exactly, and elsewhere zeros (or, for a block of columns viewed full-shape,
    its block's own bytes), never another tensor's bytes."""
    assert set(seen) == set(SHAPES)
    for name, tensor in sent.items():
        region = boxes(rank).get(name)
        if region is None:
            assert seen[name].equal(tensor), name
            continue
        assert seen[name][region].equal(tensor[region]), name
        outside = torch.ones(tensor.shape, dtype=torch.bool)
        outside[region] = False
        if DIMS[name] == 0:  # rows: the bytes outside the region are zeros, never another tensor's
            assert not seen[name][outside].any(), name
        else:  # a block of a tensor sent block after block, viewed full-shape: its other elements are its
            # block's bytes or zeros (weightsync.core.wire.blocks.block_view), never other bytes
            others = seen[name][outside]
            assert torch.isin(others[others != 0], tensor[region]).all(), name


def test_a_carried_stream_holds_only_each_span_and_a_view_is_its_rank_s_regions_on_zeros(pair: Pair,
                                                                                         rank: int) -> None:
    """The sender sends its rank's half of each split tensor (and the norm whole): its bytes are the part's, about
    half the model; each view the receiver yields (the carrier vLLM's loaders would narrow) holds the rank's region
    exactly, and elsewhere zeros; the receiver's check of its part's sums passes. Twice, so the second update
    reuses what the first planned."""
    total = sum(math.prod(shape) * 2 for shape in SHAPES.values())
    for seed in (1, 2):
        sent = model(seed)
        report, seen = pair.views(sent)
        assert report.nbytes == part_bytes(rank) < 0.6 * total
        check_views(seen, sent, rank)


def test_a_part_holder_gathers_only_its_regions_of_a_split_tensor_in_a_buffer_kept_across_updates(rank: int) -> None:
    """Without ``carry`` every byte of the model travels, in buckets of 2 KiB that split every tensor but the norm;
    the receiver gathers of each only its part's bytes (``weightsync.core.pipeline.gather``), so its views are as a
    carrier's: the rank's regions on zeros, though the gather buffer held the other rank's bytes of the tensors
    before. One buffer serves every split tensor, the same from the second update on (grown to the largest in the
    first, its pages faulted in once)."""
    for made in pair_of(rank, carry=False, bucket=2 << 10):
        where: list[dict[str, int]] = [{}, {}, {}]
        for seed, addresses in zip((5, 6, 7), where):
            sent = model(seed)
            report, seen = made.views(sent, addresses)
            assert report.nbytes == sum(tensor.nbytes for tensor in sent.values())
            check_views(seen, sent, rank)
        assert where[1] == where[2]
        assert len(set(where[1].values()) - {where[1]["norm"]}) == 1


def test_a_carried_stream_lands_each_region_in_a_shard_and_in_a_full_shape_destination(pair: Pair,
                                                                                       rank: int) -> None:
    """``copy_into``: shards (destinations of a region's shape) take the rank's region, full-shape destinations take
    it where it belongs and keep every other element as it was: contiguous ones, and matrices transposed in memory,
    which no compiled copy fills (each piece goes through its view, a carrier with zeros outside the span)."""
    sent = model(3)
    regions = boxes(rank)
    shards = {name: torch.empty(tensor[regions[name]].shape if name in regions else tensor.shape,
                                dtype=torch.bfloat16) for name, tensor in sent.items()}
    report = pair.into(sent, shards)
    assert report.nbytes == part_bytes(rank)
    for name, tensor in sent.items():
        assert shards[name].equal(tensor[regions[name]] if name in regions else tensor), name
    for transposed in (False, True):
        full = {name: filled(tensor.shape, 7.0, torch.bfloat16, transposed=transposed) for name, tensor in sent.items()}
        pair.into(sent, full)
        for name, tensor in sent.items():
            region = regions.get(name, tuple(slice(None) for _ in tensor.shape))
            assert full[name][region].equal(tensor[region]), (name, transposed)
            outside = torch.ones(tensor.shape, dtype=torch.bool)
            outside[region] = False
            assert (full[name][outside] == 7.0).all(), (name, transposed)


def test_without_carry_the_whole_model_travels() -> None:
    """The control: the same pair planned without ``carry`` sends every byte of the model (its views are whole)."""
    sent = model(4)
    for made in pair_of(0, carry=False):
        report, seen = made.views(sent)
        assert report.nbytes == sum(tensor.nbytes for tensor in sent.values())
        assert all(seen[name][boxes(0)[name]].equal(tensor[boxes(0)[name]]) for name, tensor in sent.items()
                   if name in boxes(0))


@pytest.mark.parametrize(("shape", "box", "blocks", "span"), [
    ((8, 4), ((2, 0), (4, 4)), None, (32, 96)),  # rows 2-5 of 4 columns, float32: 16 bytes a row
    ((8, 4), ((0, 2), (8, 2)), None, (8, 128)),  # a block of columns in the tensor's own order: rows 0-7
    ((8, 4), ((0, 2), (8, 2)), (1, 2), (64, 128)),  # the same block, the tensor packed block after block
    ((8, 4), ((0, 0), (8, 4)), None, None),  # the whole tensor
])
def test_carried_span_is_the_regions_first_byte_to_last_in_the_order_it_travels(
        shape: tuple[int, ...], box: tuple[tuple[int, ...], tuple[int, ...]], blocks: tuple[int, int] | None,
        span: tuple[int, int] | None) -> None:
    assert carried_span([box], shape, 4, blocks, name="t") == span
    assert carried_span(None, shape, 4, blocks, name="t") is None


def test_carried_span_is_the_hull_of_the_byte_runs_and_refuses_a_box_that_does_not_fit() -> None:
    """Against the byte runs a part's sums read (``wire.parts.byte_runs``): random boxes of random shapes, the span
    runs from their first run's start to their last run's end; a box past the tensor's edge is a ``ConfigError``
    naming it."""
    import random

    from weightsync.api.errors import ConfigError
    from weightsync.core.wire.parts import byte_runs

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        boxes = []
        for _ in range(rng.randint(1, 3)):
            start = tuple(rng.randint(0, extent - 1) for extent in shape)
            boxes.append((start, tuple(rng.randint(0, extent - at) for at, extent in zip(start, shape))))
        starts, ends = byte_runs(boxes, shape, 2, name="t")
        hull = (starts[0], ends[-1]) if starts else (0, 0)
        assert carried_span(boxes, shape, 2, None, name="t") == (None if hull == (0, math.prod(shape) * 2) else hull)
    with pytest.raises(ConfigError, match="'t' does not fit"):
        carried_span([((0, 3), (2, 2))], (4, 4), 2, None, name="t")
