"""Sharded sources in core: a shard's byte range, the plan of who sends what (checked before any pause), the planner's
pieces of a shard, and the receiver that reads several senders' streams in turn."""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
from typing import Any

import msgspec
import pytest
import torch

from weightsync.api.errors import TopologyError, TransferError, WeightStreamError, WireError
from weightsync.api.parts import PART_KEY, Part, Region
from weightsync.api.sources import SOURCE_KEY, Holding, Shard, SourceLayout, byte_range
from weightsync.api.types import WorkerContext, WorldMetadata
from weightsync.core.control.parts import with_declared_parts
from weightsync.core.delta.copies import PlacedCopies
from weightsync.core.delta.sources import SourcesDelta
from weightsync.core.pipeline.planner import plan_buckets, validate_pair
from weightsync.core.wire.layout import pack_piece
from weightsync.core.pipeline.receive import BucketOrder
from weightsync.core.transports.seam import ReceivedBucket
from weightsync.core.transports.sources import SourcesReceiver, plan_sources
from weightsync.core.wire import codec
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.wire.sources import combine_sources
from weightsync.shm import ShmCheckpointEngine

from tests.core.test_carriers import DIMS, SHAPES, boxes, check_views
from tests.core.test_carriers import model as carriers_model

CPU = frozenset({"cpu"})


def rows(shape: tuple[int, ...], first: int, count: int) -> Holding:
    return Holding(shape=shape, region=Region.narrow(shape, 0, first, count))


def world(layouts: list[dict[str, Holding] | None], parts: list[Part | None] | None = None) -> WorldMetadata:
    actor = [{} if layout is None else {SOURCE_KEY: SourceLayout(tensors=layout).to_dict()} for layout in layouts]
    rollout = [{} if part is None else {PART_KEY: part.to_dict()} for part in (parts or [None])]
    return WorldMetadata(actor=actor, rollout=rollout)  # type: ignore[arg-type]


def test_byte_range_is_a_block_of_rows_or_nothing() -> None:
    assert byte_range((50, 4), Region.narrow((50, 4), 0, 17, 17), 2) == (17 * 4 * 2, 34 * 4 * 2)
    assert byte_range((2, 3, 4), Region(start=(1, 1, 0), size=(1, 2, 4))) == (16, 24)
    assert byte_range((50, 4), Region.narrow((50, 4), 0, 50, 0)) == (0, 0)  # an empty shard
    assert byte_range((), Region(start=(), size=()), 4) == (0, 4)  # a scalar
    assert byte_range((4, 8), Region.narrow((4, 8), 1, 0, 4)) is None  # a block of columns


def test_every_rank_sends_its_rows_and_one_holder_sends_a_replicated_tensor() -> None:
    shape = (50, 4)
    layouts: list[dict[str, Holding] | None] = [
        {"w": rows(shape, 0, 17), "norm": Holding(shape=(4,), region=Region.whole((4,))), "b": rows((2,), 0, 1)},
        {"w": rows(shape, 17, 17), "norm": Holding(shape=(4,), region=Region.whole((4,))), "b": rows((2,), 1, 1)},
        {"w": rows(shape, 34, 16), "norm": Holding(shape=(4,), region=Region.whole((4,))), "b": rows((2,), 2, 0)}]
    plan = plan_sources(world(layouts))
    assert plan is not None and plan.senders == (0, 1, 2)
    # The norm is sent once, by one of its three holders; the others leave it out. The empty shard skips nothing.
    assert sorted(rank for rank in plan.senders if "norm" in plan.skip[rank]) in ([0, 1], [0, 2], [1, 2])
    assert all("w" not in plan.skip[rank] and "b" not in plan.skip[rank] for rank in plan.senders)


def test_no_layout_is_no_plan_and_a_missing_one_is_named() -> None:
    assert plan_sources(world([None, None])) is None
    with pytest.raises(TopologyError, match="actor rank 1 declared no source layout"):
        plan_sources(world([{"w": rows((4, 2), 0, 4)}, None]))


def test_rows_nobody_holds_are_named_with_the_worker_that_needs_them() -> None:
    shape = (8, 2)
    layouts: list[dict[str, Holding] | None] = [{"w": rows(shape, 0, 4)}, {"w": rows(shape, 6, 2)}]
    with pytest.raises(TopologyError, match=r"rollout rank 0 needs elements \[8, 12\) of 'w'"):
        plan_sources(world(layouts))
    # A worker whose part holds only rows that are held is served (the negative control of the check above).
    first_half = Part(tensors={"w": (Region.narrow(shape, 0, 0, 4),)})
    assert plan_sources(world(layouts, [first_half])) is not None
    second = Part(tensors={"w": (Region.narrow(shape, 0, 4, 4),)})
    with pytest.raises(TopologyError, match="rollout rank 1 needs"):
        plan_sources(world(layouts, [first_half, second]))


def test_shapes_columns_and_overlaps_are_refused_by_name() -> None:
    with pytest.raises(TopologyError, match="hold 'w' with shapes"):
        plan_sources(world([{"w": rows((4, 2), 0, 2)}, {"w": rows((4, 3), 2, 2)}]))
    with pytest.raises(TopologyError, match="not one contiguous range"):
        plan_sources(world([{"w": Holding(shape=(4, 2), region=Region.narrow((4, 2), 1, 0, 1))}]))
    with pytest.raises(TopologyError, match="overlapping"):
        plan_sources(world([{"w": rows((4, 2), 0, 3)}, {"w": rows((4, 2), 2, 2)}]))
    with pytest.raises(TopologyError, match="does not fit"):
        plan_sources(world([{"w": rows((4, 2), 0, 4)}], [Part(tensors={"w": (Region(start=(3, 0), size=(2, 2)),)})]))


def test_a_shard_travels_as_its_range_of_the_full_tensor() -> None:
    full = torch.arange(50 * 4, dtype=torch.float32).view(50, 4)
    items = [("a", Shard(tensor=full[17:34].clone(), shape=(50, 4), start=(17, 0))), ("b", torch.ones(3)),
             ("c", Shard(tensor=full[50:], shape=(50, 4), start=(50, 0)))]  # c: an empty shard, an empty range
    metas = [meta for bucket in plan_buckets(items, bucket_bytes=128, devices=CPU) for meta, _, _ in bucket.items]
    assert [(meta.name, meta.offset, meta.nbytes, meta.total_nbytes) for meta in metas] == [
        ("a", 272, 128, 800), ("a", 400, 128, 800), ("a", 528, 16, 800), ("b", 0, 12, 12), ("c", 0, 0, 800)]
    with pytest.raises(WeightStreamError, match="not one contiguous range"):
        list(plan_buckets([("a", Shard(tensor=full[:, :2].clone(), shape=(50, 4), start=(0, 0)))],
                          bucket_bytes=128, devices=CPU))
    with pytest.raises(WeightStreamError, match="moves whole tensors"):
        validate_pair(items[0], devices=CPU, seen=set())


def test_a_shard_of_a_tensor_packed_block_after_block_is_a_range_of_each_block() -> None:
    """Rows 1-2 of a 4 x 4 matrix in two blocks of columns: a range of each block (rows 1-2 of block 0, then of block
    1), each packed from the shard's own rows; a shard that is not a block of rows cannot be cut so and is named."""
    from weightsync.core.wire.blocks import BlockPlan

    full = torch.arange(16, dtype=torch.float32).view(4, 4)
    blocked = {"w": BlockPlan(dim=1, count=2, size=(4, 2))}
    items = [("w", Shard(tensor=full[1:3].clone(), shape=(4, 4), start=(1, 0)))]
    buckets = list(plan_buckets(items, bucket_bytes=1024, devices=CPU, blocked=blocked))
    metas = [meta for meta, _, _ in buckets[0].items]
    assert [(meta.offset, meta.nbytes, meta.blocks) for meta in metas] == [(8, 16, (1, 2)), (40, 16, (1, 2))]
    packed = torch.empty(buckets[0].nbytes, dtype=torch.uint8)
    for item in buckets[0].items:
        pack_piece(packed, buckets[0], item)
    assert [packed[meta.bucket_offset:meta.bucket_offset + 16].view(torch.float32).tolist() for meta in metas] == [
        [4.0, 5.0, 8.0, 9.0], [6.0, 7.0, 10.0, 11.0]]  # block 0's rows 1-2, block 1's
    row = torch.arange(4, dtype=torch.float32).view(1, 4)
    with pytest.raises(WeightStreamError, match="is not a block of rows"):
        list(plan_buckets([("v", Shard(tensor=row[:, 2:].clone(), shape=(1, 4), start=(0, 2)))], bucket_bytes=1024,
                          devices=CPU, blocked={"v": BlockPlan(dim=1, count=2, size=(1, 2))}))


def test_shards_fill_every_bucket_where_a_whole_tensor_would_close_it() -> None:
    """A shard of a bucket's size after a small one is split where the open bucket ends (its receivers gather the
    tensor's ranges anyway), so every bucket but the last is full; the same tensors whole close the bucket instead
    (a tensor that fits a fresh bucket is kept whole)."""
    full, norm = torch.zeros(8, 256, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.uint8)
    shards = [item for layer in range(3) for item in (
        (f"w{layer}", Shard(tensor=full[:4], shape=(8, 256), start=(0, 0))),
        (f"n{layer}", Shard(tensor=norm[:1], shape=(2, 8), start=(0, 0))))]
    # (pieces start at multiples of BUCKET_ALIGNMENT, 256)
    assert [bucket.nbytes for bucket in plan_buckets(shards, bucket_bytes=1024, devices=CPU)] == [1024] * 3 + [520]
    whole = [(name, torch.zeros(1024 if name[0] == "w" else 8, dtype=torch.uint8)) for name, _ in shards]
    assert [bucket.nbytes for bucket in plan_buckets(whole, bucket_bytes=1024, devices=CPU)] == [1024, 8] * 3


class Stream:
    """A source of buckets: ``count`` buckets of sender ``sender``, then its final header."""

    def __init__(self, sender: int, count: int, *, digest: str = "d", parts: list[bytes] | None = None,
                 base: int = -1, model: str = "") -> None:
        self.sender, self.count, self.sent, self.base, self.model = sender, count, 0, base, model
        self.capacity = 64
        self.digest, self.parts = digest, parts or []
        self.released: list[int] = []
        self.payload = torch.zeros(64, dtype=torch.uint8)

    def receive(self, deadline: float) -> ReceivedBucket:
        fields: dict[str, Any] = dict(wire=codec.WIRE_VERSION, epoch="e", version=1, sender=self.sender, slot=0,
                                      nbytes=0, tensors=[])
        if self.sent < self.count:
            self.sent += 1
            return ReceivedBucket(codec.encode(codec.BucketHeader(index=self.sent - 1, **fields)), self.payload,
                                  self.sent)
        final = codec.BucketHeader(index=self.count, final=True, digest=self.digest, parts=self.parts, base=self.base,
                                   model=self.model, **{**fields, "slot": codec.NO_SLOT})
        return ReceivedBucket(codec.encode(final), self.payload[:0], 0)

    def release(self, token: int) -> None:
        self.released.append(token)

    def close(self) -> None:
        pass


def decoded(received: ReceivedBucket) -> codec.BucketHeader:
    return codec.decode_bucket(received.header, epoch="e", capacity=64)[0]


def test_the_receiver_takes_each_sender_in_turn_then_merges_their_finals() -> None:
    streams = [Stream(3, 3, digest="aa", parts=[b"A1", b"A2"]), Stream(5, 1, digest="bb", parts=[b"B1", b"B2"])]
    receiver = SourcesReceiver(streams, [3, 5], epoch="e")
    order = []
    while True:
        received = receiver.receive(0.0)
        header = decoded(received)
        if header.final:
            break
        order.append((header.sender, header.index))
        receiver.release(received.token)
    assert order == [(3, 0), (5, 0), (3, 1), (3, 2)]
    assert streams[0].released == [1, 2, 3] and streams[1].released == [1]  # each in its own order
    assert header.digest == combine_sources(["aa", "bb"]) and header.index == 4
    assert header.parts == [b"A1B1", b"A2B2"]
    assert header.ends == [codec.StreamEnd(3, 3, -1, ""), codec.StreamEnd(5, 1, -1, "")] and not header.model


def test_the_merged_final_keeps_each_senders_end_for_its_delta_state() -> None:
    streams = [Stream(3, 1, base=6, model="m3"), Stream(5, 2, base=6, model="m5")]
    receiver = SourcesReceiver(streams, [3, 5], epoch="e")
    while not (header := decoded(received := receiver.receive(0.0))).final:
        receiver.release(received.token)
    assert header.ends == [codec.StreamEnd(3, 1, 6, "m3"), codec.StreamEnd(5, 2, 6, "m5")]
    assert header.base == 6 and header.model == combine_sources(["m3", "m5"])


def test_delta_from_several_senders_is_refused_where_their_bases_differ_or_one_is_not_held() -> None:
    """Refused at a stream's first bucket, before anything is written: one sender sending changes where another
    sends its stream whole, and changes against a base this receiver does not hold from that sender."""
    fields: dict[str, Any] = dict(wire=codec.WIRE_VERSION, epoch="e", version=2, slot=0, nbytes=0, tensors=[],
                                  index=0)
    delta = SourcesDelta(verify_every=1)
    delta.begin()
    delta.check_base(codec.BucketHeader(sender=0, base=-1, **fields), "p")
    with pytest.raises(TransferError, match="actor rank 1 sent its stream against base 1 and actor rank 0 against -1"):
        delta.check_base(codec.BucketHeader(sender=1, base=1, base_model="m", **fields), "p")
    delta.begin()
    with pytest.raises(TransferError, match="changes against version 1, but this receiver holds no version"):
        delta.check_base(codec.BucketHeader(sender=1, base=1, base_model="m", **fields), "p")


def test_a_tensor_the_fallback_takes_is_handed_over_once_every_senders_range_was_written() -> None:
    copies = PlacedCopies()
    copies.begin()
    tail = codec.TensorMeta(name="w", dtype="uint8", shape=(8,), offset=4, nbytes=4, total_nbytes=8)
    head = codec.TensorMeta(name="w", dtype="uint8", shape=(8,), offset=0, nbytes=4, total_nbytes=8)
    assert copies.get(tail, fresh=True) is copies.get(head, fresh=True)  # one copy for every sender's range
    assert not copies.written(tail)  # the tail first (another sender's stream), then the head completes it
    assert copies.written(head)
    copies.begin()  # the next update: changes apply to the copy kept
    assert copies.get(head, fresh=False).numel() == 8


def test_a_final_in_another_senders_stream_is_a_wire_error() -> None:
    receiver = SourcesReceiver([Stream(3, 0), Stream(4, 0)], [3, 5], epoch="e")
    with pytest.raises(WireError, match="ended the stream of actor rank 5"):
        receiver.receive(0.0)


def test_senders_ranges_of_a_tensor_in_two_layouts_or_short_of_it_are_wire_errors() -> None:
    """What each sender's digest cannot show: one sender's range of a tensor packed block after block where another's
    is in the tensor's own order (refused as it arrives, before it is written), and ranges that do not add up to the
    tensor (at the end)."""
    fields: dict[str, Any] = dict(wire=codec.WIRE_VERSION, epoch="e", version=2, slot=0, nbytes=0)
    meta = codec.TensorMeta(name="o", dtype="uint8", shape=(4, 4), offset=0, nbytes=8, total_nbytes=16)
    order = BucketOrder(sources=True)
    order.take(codec.BucketHeader(sender=0, index=0, tensors=[msgspec.structs.replace(meta, blocks=(1, 2))], **fields))
    with pytest.raises(WireError, match=r"actor rank 1 sent 'o' in its own order and actor rank 0 block after block"):
        order.take(codec.BucketHeader(sender=1, index=0, tensors=[msgspec.structs.replace(meta, offset=8)], **fields))
    order = BucketOrder(sources=True)
    order.take(codec.BucketHeader(sender=0, index=0, tensors=[meta], **fields))
    with pytest.raises(WireError, match="sent 8 bytes of 'o', which has 16"):
        order.check_complete()
    order.take(codec.BucketHeader(sender=1, index=0, tensors=[msgspec.structs.replace(meta, offset=8)], **fields))
    order.check_complete()


def chain_world(rollout: list[tuple[str, int]], *, staged: bool = False, ranks: int = 2) -> WorldMetadata:
    """Two sharded actor ranks on host a (rails 0 and 1), and rollout workers on ``(host, rail)``."""
    layouts = [{"w": rows((8, 2), 4 * rank, 4)} for rank in range(ranks)]
    actor = [{SOURCE_KEY: SourceLayout(tensors=layout).to_dict(), "node_id": "a", "rail": rank,
              "address": f"10.0.{rank}.1:{1000 + rank}", "library": "tcp", "layout": "two_level", "staged": staged}
             for rank, layout in enumerate(layouts)]
    workers = [{"node_id": host, "rail": rail, "address": f"10.{index}.0.2:2000", "library": "tcp"}
               for index, (host, rail) in enumerate(rollout)]
    return WorldMetadata(actor=actor, rollout=workers)  # type: ignore[arg-type]


def test_across_hosts_each_ranks_stream_is_led_into_each_host_by_a_worker_of_its_own() -> None:
    from weightsync.core.transports.chain.plan import StreamsReceive
    from weightsync.core.transports.chain.sources import sharded_topology
    from weightsync.core.transports.plan import decode_plan

    metadata = chain_world([("b", 1), ("b", 0), ("c", 0), ("c", 1)])
    plan = plan_sources(metadata)
    assert plan is not None
    topology = sharded_topology("tcp", metadata, plan, fanout=1, addresses=[
        str(worker["address"]) for worker in metadata.rollout])
    assert topology.sharded and topology.senders == (0, 1)
    receives = [decode_plan(args, StreamsReceive, who="test") for args in topology.rollout]
    # On each host the rail-0 worker leads rank 0's stream, the rail-1 worker rank 1's; the other reads in place.
    led = [[not source.local for source in receive.sources] for receive in receives]
    assert led == [[False, True], [True, False], [True, False], [False, True]]
    assert all(receive.streams == (0, 1) for receive in receives)
    # Host c's leaders read from host b's (the two-level chain of hosts), each stream over its own rail.
    assert receives[2].sources[0].upstream_position == 2 and receives[3].sources[1].upstream_position == 1


def test_across_hosts_a_host_with_fewer_workers_than_ranks_is_refused() -> None:
    from weightsync.core.control.staged import StagedPlan
    from weightsync.core.transports.chain.sources import sharded_topology

    metadata = chain_world([("b", 0)])
    plan = plan_sources(metadata)
    assert plan is not None
    with pytest.raises(TopologyError, match="host b has 1 rollout workers"):
        sharded_topology("tcp", metadata, plan, fanout=1, addresses=["x"])
    with pytest.raises(TopologyError, match="stage each rank's stream on host c, which has 1"):
        StagedPlan.of(chain_world([("b", 0), ("b", 1), ("c", 1)], staged=True))


def test_across_hosts_staged_each_hosts_stagers_stage_a_ranks_stream_each() -> None:
    """Staged: each host has a stager per sending rank (its first worker on the rank's rail), and only they join;
    each stages one rank's stream, read over that rank's rail (host c's from host b's stager of the same stream)."""
    from weightsync.core.control.staged import StagedPlan
    from weightsync.core.transports.chain.plan import StreamsReceive
    from weightsync.core.transports.chain.sources import sharded_topology
    from weightsync.core.transports.plan import decode_plan

    world = chain_world([("b", 1), ("b", 0), ("b", 0), ("c", 0), ("c", 1)], staged=True)
    staged = StagedPlan.of(world)
    assert staged.stagers == {"b": (1, 0), "c": (3, 4)} and staged.members == [0, 1, 3, 4]
    members = WorldMetadata(actor=world.actor, rollout=[world.rollout[index] for index in staged.members])
    plan = plan_sources(members)
    assert plan is not None
    topology = sharded_topology("tcp", members, plan, fanout=1, addresses=[
        str(worker["address"]) for worker in members.rollout])
    receives = [decode_plan(args, StreamsReceive, who="test") for args in topology.rollout]
    assert [receive.streams for receive in receives] == [(1,), (0,), (0,), (1,)]
    assert all(len(receive.sources) == 1 and not receive.sources[0].local for receive in receives)
    assert [receive.sources[0].upstream_position for receive in receives] == [0, 0, 2, 1]
    assert [source.route.rail for receive in receives for source in receive.sources if source.route] == [1, 0, 0, 1]


def test_module_shards_of_an_unsharded_module_are_whole_tensors_renamed_and_cast() -> None:
    """A module that is not under FSDP (or a part of one left unwrapped) is held whole by every rank: its tensors go
    as they are, renamed and cast as asked, persistent buffers with ``buffers=True``, and the layout says whole."""
    from weightsync.core import ModuleShards

    module = torch.nn.Linear(4, 3)
    module.register_buffer("steps", torch.arange(3))
    module.register_buffer("scratch", torch.zeros(2), persistent=False)
    source = ModuleShards(module, buffers=True, rename=lambda name: f"model.{name}", dtype=torch.bfloat16)
    streamed = {name: tensor for name, tensor in source.named_weights() if isinstance(tensor, torch.Tensor)}
    assert list(streamed) == ["model.weight", "model.bias", "model.steps"]  # the non-persistent buffer is left out
    assert [tensor.dtype for tensor in streamed.values()] == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert torch.equal(streamed["model.weight"], module.weight.detach().to(torch.bfloat16))
    layout = source.source_layout()
    assert layout.tensors["model.weight"] == Holding(shape=(3, 4), region=Region.whole((3, 4)))
    with pytest.raises(WeightStreamError, match="two tensors of the module are named 'same'"):
        list(ModuleShards(module, rename=lambda name: "same").named_weights())


class ShardedPair:
    """Two shm senders holding the rows of every tensor of ``tests.core.test_carriers.SHAPES`` half each (a sharded
    ``actor_wg``: ``Shard(0)``), and receivers in this process, each of one rank's part (``ranks``) or of the whole
    model (None)."""

    def __init__(self, ranks: list[int | None], *, bucket: int, rows_of: Any = None) -> None:
        self.rows_of = rows_of or (lambda name, rows, sender: (sender * (rows // 2), rows // 2))
        """``(name, rows, sender) -> (first, count)``: the rows each sender holds of each tensor (default: halves)."""
        context = [WorkerContext(role="actor", rank=sender, node_id="host") for sender in (0, 1)]
        self.senders = [ShmCheckpointEngine(bucket_bytes=bucket, timeout=10.0, context=each) for each in context]
        self.receivers = [ShmCheckpointEngine(bucket_bytes=bucket, timeout=10.0,
                                              context=WorkerContext(role="rollout", rank=index, node_id="host"))
                          for index in range(len(ranks))]
        actor = [{**sender.prepare(), SOURCE_KEY: SourceLayout(tensors={
            name: rows(shape, *self.rows_of(name, shape[0], index)) for name, shape in SHAPES.items()}).to_dict()}
            for index, sender in enumerate(self.senders)]
        parts = [Part.split(SHAPES, dims=DIMS, rank=rank, parts=2) if rank is not None else None for rank in ranks]
        rollout = [{**receiver.prepare(), **({PART_KEY: part.to_dict()} if part is not None else {})}
                   for receiver, part in zip(self.receivers, parts)]
        topology = ShmCheckpointEngine.build_topology(actor_wg_world_size=2, rollout_world_size=len(ranks),
                                                      metadata=WorldMetadata(actor=actor, rollout=rollout))
        actor_args, rollout_args = list(topology.actor), list(topology.rollout)
        distinct = sorted({rank for rank in ranks if rank is not None})
        with_declared_parts(actor_args, rollout_args, [
            PartPlan.of(part, distinct.index(rank)) if part is not None and rank is not None else None
            for part, rank in zip(parts, ranks)])
        engines = [*self.senders, *self.receivers]
        with concurrent.futures.ThreadPoolExecutor(len(engines)) as pool:
            for future in [pool.submit(engine.init_process_group, rank_args=args)
                           for engine, args in zip(engines, [*actor_args, *rollout_args])]:
                future.result()

    def update(self, sent: dict[str, torch.Tensor], receive: Any) -> list[Any]:
        """One update from both senders' shards of ``sent``; each receiver's ``receive(engine, stream)`` (awaited)."""
        async def all_of_it() -> list[Any]:
            shards = [[(name, self.shard(name, tensor, index)) for name, tensor in sent.items()] for index in (0, 1)]
            sending = [asyncio.ensure_future(sender.send_weights(items)) for sender, items in zip(self.senders, shards)]
            received = await asyncio.gather(*(receive(index, receiver.receive_weights())
                                              for index, receiver in enumerate(self.receivers)))
            await asyncio.gather(*sending)
            return received

        return asyncio.run(all_of_it())

    def shard(self, name: str, tensor: torch.Tensor, sender: int) -> Shard:
        first, count = self.rows_of(name, tensor.shape[0], sender)
        return Shard(tensor=tensor[first:first + count].clone(), shape=tuple(tensor.shape),
                     start=(first,) + (0,) * (tensor.dim() - 1))

    def views(self, sent: dict[str, torch.Tensor], addresses: dict[str, int]) -> dict[str, torch.Tensor]:
        """One update into one receiver, each view copied as it comes and the buffer it lay in noted in
        ``addresses``."""
        async def viewed(index: int, stream: Any) -> dict[str, torch.Tensor]:
            seen = {}
            async for name, view in stream:
                seen[name] = view.clone()
                addresses[name] = view.untyped_storage().data_ptr()
            return seen

        seen: dict[str, torch.Tensor] = self.update(sent, viewed)[0]
        return seen

    def close(self) -> None:
        for engine in [*self.senders, *self.receivers]:
            engine.close()


@pytest.mark.parametrize("rank", [0, 1, None], ids=["rank0", "rank1", "whole"])
def test_views_from_several_senders_are_gathered_in_buffers_kept_across_updates_a_part_holder_s_on_zeros(
        rank: int | None) -> None:
    """Every tensor arrives as two senders' ranges, in buckets of 2 KiB that split the larger ones too, so each is
    gathered (``weightsync.core.pipeline.gather.Gathers``). The views of a worker of a part hold its regions exactly
    and zeros elsewhere, never another tensor's bytes (its buffers held other tensors before); a whole-model worker's
    hold the tensors. From the second update on every view lies in a buffer the update before used, and the engine
    keeps a few, not one per tensor (before, each tensor of each update had a fresh buffer of its own)."""
    made = ShardedPair([rank], bucket=2 << 10)
    try:
        where: list[dict[str, int]] = [{}, {}, {}]
        for seed, addresses in zip((5, 6, 7), where):
            sent = carriers_model(seed)
            seen = made.views(sent, addresses)
            if rank is not None:
                check_views(seen, sent, rank)
            else:
                assert set(seen) == set(sent) and all(seen[name].equal(sent[name]) for name in sent)
        buffers = set(where[0].values())
        assert set(where[1].values()) <= buffers and set(where[2].values()) <= buffers
        assert len(buffers) < len(SHAPES)
    finally:
        made.close()


@pytest.mark.parametrize(("loading", "split"), [("views", "halves"), ("shards", "halves"), ("views", "uneven")])
def test_blocks_of_columns_from_several_senders_travel_block_after_block_each_worker_copying_one_run_a_piece(
        loading: str, split: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both workers of a replica declare their part, so the tensors split along a dimension past the first (``o``,
    ``down``, ``experts``) travel block after block (``weightsync.core.wire.blocks``), from a sharded ``actor_wg``
    too: each sender packs its rows of each block as a range of that block. A worker's block of columns is then
    contiguous in every piece, so it copies one run of each (the gather's and the shards' copies are counted where
    they call the compiled copy), where each row was a run of its own before; views and shards hold exactly the
    part, update after update, and each worker's sums (checked against both senders') match. ``uneven``: one sender
    holds every row of ``o`` and the other none (its empty pieces share their place in a bucket with the next piece:
    they have no rows to pack), three rows of ``down`` against 29."""
    import weightsync.core.pipeline.gather as gather
    import weightsync.core.pipeline.unpack as unpack

    runs: list[int] = []  # per call: the runs it copies
    for module, name in ((gather, "copy_batch"), (unpack, "copy_batch"), (unpack, "copy_stream")):
        def counted(first: Any, *args: Any, original: Any = getattr(module, name), **kwargs: Any) -> None:
            runs.append(len(first) // 3 if isinstance(first, (list, array.array)) else 1)
            original(first, *args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    async def viewed(rank: int, stream: Any) -> dict[str, torch.Tensor]:
        return {name: view.clone() async for name, view in stream}

    async def into_shards(rank: int, stream: Any) -> dict[str, torch.Tensor]:
        shards = {name: torch.zeros(shape, dtype=torch.bfloat16)[boxes(rank).get(name, ())].contiguous()
                  for name, shape in SHAPES.items()}
        await stream.copy_into(shards)
        return shards

    def uneven(name: str, rows: int, sender: int) -> tuple[int, int]:
        first = {"o": rows, "down": 3}.get(name, rows // 2)
        return (0, first) if sender == 0 else (first, rows - first)

    made = ShardedPair([0, 1], bucket=2 << 10, rows_of=uneven if split == "uneven" else None)
    try:
        for seed in (5, 6, 7):
            sent = carriers_model(seed)
            runs.clear()
            held = made.update(sent, viewed if loading == "views" else into_shards)
            for rank, seen in enumerate(held):
                if loading == "views":
                    check_views(seen, sent, rank)
                else:
                    assert all(seen[name].equal(tensor[boxes(rank).get(name, ())]) for name, tensor in sent.items())
            assert runs and max(runs) == 1, runs  # one run of each piece (rows of 64 to 256 bytes each before)
    finally:
        made.close()
