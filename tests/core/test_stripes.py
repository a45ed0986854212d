"""Stripes through the real pipeline (:mod:`weightsync.core.transports.chain.stripes`): K sender engines each send
stripe s of K (bucket i in stripe i mod K), and receivers read the K stripes back through a ``StripedReceiver`` in
bucket order, checking one digest that combines the senders' (``combine_stripes``).

The transport here is an in-memory one written for this test (each published bucket copied to every receiver's
queue of that stripe), so what is tested is core's part: the senders' stripe filter, the merge, the tokens and the
digests. Every check reads from outside the engines: the bytes each destination holds, the buckets each sender
published (counted by the transport), the digests the engines report.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Union

import pytest
import torch

from weightsync.api.errors import DigestMismatchError, PartMismatchError, WireError
from weightsync.api.testing import case_tensors, raw_bytes
from weightsync.api.types import Topology, TransferReport, WorkerContext, WorldMetadata
from weightsync.core.backend import RankPlan, RankRole, Transport, encode_plan, engine_class
from weightsync.core.control.round import Round
from weightsync.core.transports.chain.stripes import StripedReceiver
from weightsync.core.transports.seam import ReceivedBucket
from weightsync.core.wire.digest import combine_stripes
from weightsync.core.wire.partplans import Box, PartPlan

BUCKET = 1 << 14
Published = tuple[bytes, torch.Tensor]


class _Sender:
    def __init__(self, queues: list[queue.Queue[Published]], capacity: int, counter: list[int]) -> None:
        self.slots, self.capacity = 2, capacity
        self._buffers = [torch.zeros(capacity, dtype=torch.uint8) for _ in range(self.slots)]
        self._queues, self._counter = queues, counter

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def wait_slot(self, slot: int, deadline: float) -> None:  # every publish copies: a slot is free at once
        return None

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        payload = self._buffers[slot][:nbytes].clone() if slot >= 0 else torch.empty(0, dtype=torch.uint8)
        self._counter[0] += slot >= 0
        for into in self._queues:
            into.put((header, payload))

    def close(self) -> None:
        return None


class _Receiver:
    def __init__(self, source: queue.Queue[Published], capacity: int, tamper: Callable[[int, torch.Tensor], None]
                 ) -> None:
        self.capacity, self._source, self._tamper = capacity, source, tamper
        self._next = 0
        self.released: list[int] = []

    def receive(self, deadline: float) -> ReceivedBucket:
        header, payload = self._source.get(timeout=max(deadline - time.monotonic(), 0.001))
        if not payload.numel():
            return ReceivedBucket(header, payload, 0)
        self._next += 1
        self._tamper(self._next, payload)
        return ReceivedBucket(header, payload, self._next)

    def release(self, token: int) -> None:
        self.released.append(token)

    def close(self) -> None:
        return None


class _World:
    """What the in-memory transport's engines share: per stripe, one queue per receiver; buckets published."""

    def __init__(self, stripes: int, receivers: int, parts: list[PartPlan] | None = None,
                 declared: list[PartPlan] | None = None) -> None:
        self.queues = [[queue.Queue[Published]() for _ in range(receivers)] for _ in range(stripes)]
        self.published = [[0] for _ in range(stripes)]
        self.order: list[int] | None = None  # which stripe each receiver's source s reads (a test may permute it)
        self.tamper: Callable[[int, int, torch.Tensor], None] = lambda stripe, token, payload: None
        self.parts = parts or []
        """The distinct parts the senders sum, if any; receiver r's is ``declared[r]`` (default ``parts[r]``)."""
        self.declared = declared or self.parts


class _MemorySend(RankPlan, tag="memory-send", frozen=True):
    role: ClassVar[RankRole] = "sender"
    stripes: int

    @property
    def striping(self) -> tuple[int, int]:
        return self.sender, self.stripes


class _MemoryReceive(RankPlan, tag="memory-receive", frozen=True):
    role: ClassVar[RankRole] = "receiver"
    stripes: int

    @property
    def striping(self) -> tuple[int, int]:
        return 0, self.stripes


class _MemoryTransport(Transport):
    name = "memory-stripes"
    world: ClassVar[_World]
    plans: ClassVar[Any] = Union[_MemorySend, _MemoryReceive]

    @classmethod
    def build_topology(cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
                       ) -> Topology:
        parts = cls.world.parts
        actor = [_MemorySend(sender=rank, stripes=actor_wg_world_size, parts=parts, parts_only=bool(parts))
                 for rank in range(actor_wg_world_size)]
        rollout = [_MemoryReceive(stripes=actor_wg_world_size, part=cls.world.declared[rank] if parts else None)
                   for rank in range(rollout_world_size)]
        return Topology(actor=[encode_plan(plan) for plan in actor], rollout=[encode_plan(plan) for plan in rollout],
                        senders=tuple(range(actor_wg_world_size)), stripes=actor_wg_world_size)

    def connect_sender(self, plan: _MemorySend) -> _Sender:
        stripe = self.settings.context.rank
        return _Sender(self.world.queues[stripe], self.settings.bucket_bytes, self.world.published[stripe])

    def connect_receiver(self, plan: _MemoryReceive) -> StripedReceiver:
        rank, world = self.settings.context.rank, self.world
        order = world.order or list(range(len(world.queues)))
        sources = [_Receiver(world.queues[stripe][rank], self.settings.bucket_bytes, _tampering(world, stripe))
                   for stripe in order]
        return StripedReceiver(sources, epoch=plan.epoch)


def _tampering(world: _World, stripe: int) -> Callable[[int, torch.Tensor], None]:
    return lambda token, payload: world.tamper(stripe, token, payload)


_Engine: Any = engine_class(_MemoryTransport)


def _update(world: _World, weights: list[tuple[str, torch.Tensor]], receivers: int) -> tuple[list[Any], list[Any]]:
    """One update from len(world.queues) stripe senders to ``receivers``; (the senders' reports, per receiver its
    destinations or the error it raised)."""
    _MemoryTransport.world = world
    stripes = len(world.queues)
    senders = [_Engine(bucket_bytes=BUCKET, timeout=30, context=WorkerContext(role="actor", rank=s, node_id="here"))
               for s in range(stripes)]
    readers = [_Engine(bucket_bytes=BUCKET, timeout=30, context=WorkerContext(role="rollout", rank=r,
                                                                              node_id="here"))
               for r in range(receivers)]
    try:
        metadata = WorldMetadata(actor=[e.prepare() for e in senders], rollout=[e.prepare() for e in readers])
        topology = _Engine.build_topology(actor_wg_world_size=stripes, rollout_world_size=receivers,
                                          metadata=metadata)
        for engine, args in zip([*senders, *readers], [*topology.actor, *topology.rollout]):
            engine.init_process_group(rank_args={**args, "epoch": "e1"})

        async def receive(engine: Any) -> Any:
            into = {name: torch.zeros_like(tensor) for name, tensor in weights}
            try:
                await engine.receive_weights().copy_into(into)
            except Exception as exc:  # noqa: BLE001 - what the test checks
                return exc
            return into

        async def run() -> list[Any]:
            return list(await asyncio.gather(*[engine.send_weights(weights, version=1) for engine in senders],
                                             *[receive(engine) for engine in readers]))

        results: list[Any] = []
        thread = threading.Thread(target=lambda: results.extend(asyncio.run(run())))
        thread.start()
        thread.join(60)
        return results[:stripes], results[stripes:]
    finally:
        for engine in [*senders, *readers]:
            engine.close()


@pytest.mark.parametrize("stripes", [1, 2, 3])
def test_every_receiver_holds_every_byte_and_the_stripes_digest_combines_the_senders(stripes: int) -> None:
    weights = case_tensors("mixed", 1, BUCKET)
    world = _World(stripes, receivers=2)
    reports, received = _update(world, weights, receivers=2)
    buckets = sum(count[0] for count in world.published)
    assert buckets >= 3 * stripes  # enough buckets for every stripe to carry several
    # Each sender published only its stripe: bucket i in stripe i mod K (counted by the transport).
    assert [count[0] for count in world.published] == [len(range(s, buckets, stripes)) for s in range(stripes)]
    assert [report.buckets for report in reports] == [buckets] * stripes  # every sender planned every bucket
    assert sum(report.nbytes for report in reports) == sum(raw_bytes(t).numel() for _, t in weights)
    for into in received:
        assert not isinstance(into, BaseException), into
        for name, tensor in weights:
            assert torch.equal(raw_bytes(into[name]), raw_bytes(tensor)), name
    if stripes == 1:
        return
    # Negative controls of the digest check: a byte changed in transit on stripe 1, and stripes read out of order.
    world = _World(stripes, receivers=1)

    def flip(stripe: int, token: int, payload: torch.Tensor) -> None:
        if stripe == 1 and token == 2:
            payload[0] ^= 1

    world.tamper = flip
    _, received = _update(world, weights, receivers=1)
    assert isinstance(received[0], DigestMismatchError), received[0]
    world = _World(stripes, receivers=1)
    world.order = [1, 0, *range(2, stripes)]
    _, received = _update(world, weights, receivers=1)
    assert isinstance(received[0], WireError), received[0]


def _halves(weights: list[tuple[str, torch.Tensor]]) -> list[PartPlan]:
    """Two parts: each tensor of two rows or more split in halves of rows (part r holds half r), the rest whole."""
    parts: list[PartPlan] = []
    for r in range(2):
        tensors: dict[str, list[Box]] = {}
        for name, tensor in weights:
            if tensor.dim() >= 2 and tensor.shape[0] >= 2:
                half = tensor.shape[0] // 2
                rows = (r * half, half if r == 0 else tensor.shape[0] - half)
                tensors[name] = [((rows[0], *([0] * (tensor.dim() - 1))), (rows[1], *tensor.shape[1:]))]
        parts.append(PartPlan(index=r, tensors=tensors))
    return parts


def _in_part(part: PartPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    boxes = part.tensors.get(name)
    if boxes is None:
        return tensor
    (start, size), = boxes
    return tensor[start[0]:start[0] + size[0]]


def test_a_worker_that_declared_its_part_reads_and_verifies_only_it_stripe_by_stripe() -> None:
    """Stripes and parts together (rails and tensor parallelism): every stripe's sender folds each part's sums over
    its own buckets, the final header carries them stripe after stripe, and each receiver copies and verifies only
    its part (``StripesSums``): its destinations hold its rows, and zeros elsewhere."""
    weights = case_tensors("mixed", 1, BUCKET)
    parts = _halves(weights)
    assert sum(len(part.tensors) for part in parts) >= 4
    world = _World(2, receivers=2, parts=parts)
    reports, received = _update(world, weights, receivers=2)
    assert all(isinstance(report, TransferReport) for report in reports), reports
    for part, into in zip(parts, received):
        assert not isinstance(into, BaseException), into
        for name, tensor in weights:
            mine = _in_part(part, name, into[name])
            assert torch.equal(raw_bytes(mine), raw_bytes(_in_part(part, name, tensor))), name
            assert int(raw_bytes(into[name]).count_nonzero()) == int(raw_bytes(mine).count_nonzero()), name
    # The control: receiver 1 holds part 1's rows but is planned as part 0 (its sums are then checked against
    # part 0's): it fails by name, receiver 0 does not.
    world = _World(2, receivers=2, parts=parts, declared=[parts[0], PartPlan(index=0, tensors=parts[1].tensors)])
    _, received = _update(world, weights, receivers=2)
    assert not isinstance(received[0], BaseException), received[0]
    assert isinstance(received[1], PartMismatchError) and "rollout rank 1" in str(received[1]), received[1]


def test_the_combined_digest_is_the_one_sender_digest_for_one_stripe_and_order_sensitive() -> None:
    a, b = "0" * 31 + "1", "0" * 31 + "2"
    assert combine_stripes([a]) == a
    assert combine_stripes([a, b]) != combine_stripes([b, a]) != a


def _report(role: Literal["actor", "rollout"], rank: int, digest: str, sender: int = 0) -> TransferReport:
    return TransferReport(role=role, rank=rank, version=1, nbytes=1, tensors=1, buckets=1, seconds=0.0,
                          digest=digest, sender=sender)


class _Worker:
    name = "w"


def test_the_manager_checks_receivers_against_the_stripes_combined_digest() -> None:
    """``Round.check_digests``: with stripes, every receiver must hold the combination of every stripe's digest,
    whichever stripe's sender its report names; without, its own sender's (several senders of the whole model, as
    kimi's ranks or one relay per node, each with the same digest)."""
    a, b = "a" * 32, "b" * 32
    striped = Round.of(1, [])
    striped.workers = [(0, _Worker()), (1, _Worker())]  # type: ignore[list-item]
    striped.senders = [_report("actor", 1, b, 1), _report("actor", 0, a)]
    striped.stripes = ((0, 1),)
    striped.reports = [_report("rollout", 0, combine_stripes([a, b])), _report("rollout", 1, combine_stripes([a, b]))]
    striped.check_digests()
    striped.reports[1] = _report("rollout", 1, a)  # negative control: only stripe 0's
    with pytest.raises(DigestMismatchError, match="replica1"):
        striped.check_digests()
    whole = Round.of(1, [])
    whole.workers = striped.workers
    whole.senders = [_report("actor", 0, a), _report("actor", 1, a, 1)]
    whole.reports = [_report("rollout", 0, a), _report("rollout", 1, a, sender=1)]
    whole.check_digests()
