"""The sender's half of the pipeline: plan → pack → publish, double-buffered, and the abort that tells receivers.

The weights stream is planned into buckets on the event loop's thread (cheap bookkeeping); packing bucket k+1 into
slot (k+1) % slots runs on a packing thread while bucket k is published on a transfer thread. Planning and packing
take turns rather than overlap: both are Python for small tensors, and two threads contending for the GIL around
every copy cost more than they save.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.api.errors import WeightStreamError
from weightsync.api.types import PhaseTiming, TransferReport
from weightsync.core import native
from weightsync.core.delta.sender import DeltaUpdate, SenderDelta
from weightsync.core.native import copy_stream
from weightsync.core.pipeline.planner import plan_buckets, validate_item
from weightsync.core.pipeline.bounce import HostBounce, Upload
from weightsync.core.pipeline.trace import Tracer
from weightsync.core.transports.device import AcceleratorOps
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.chain.stripes import stripe_of
from weightsync.core.transports.device import DevicePolicy
from weightsync.core.transports.seam import NO_SLOT, SenderTransport
from weightsync.core.wire import codec
from weightsync.core.wire.blocks import BlockPlan
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.layout import PlannedBucket, pack_hashing, pack_piece
from weightsync.core.wire.parts import PartLayout, PartsDigest, PartSums
from weightsync.core.wire.partplans import Box

__all__ = ["SendPipeline", "StreamPlan", "drain"]


@dataclass(frozen=True)
class StreamPlan:
    """What a sender's plan (``RankPlan``) says its stream carries, beyond its receivers' distinct parts."""

    parts_only: bool = False
    """Every receiver verifies its part (``RankPlan.parts_only``): no whole digest is computed."""
    skip: frozenset[str] = frozenset()
    """The tensors left out (``RankPlan.skip``): the stream is still drained whole."""
    blocked: Mapping[str, BlockPlan] = field(default_factory=dict)
    """The tensors to pack block after block when the update is verified by parts (``RankPlan.blocked``)."""
    carry: Mapping[str, Sequence[Box]] = field(default_factory=dict)
    """The tensors of which only the span of these regions travels (``RankPlan.carry``: ``wire.carriers``)."""


async def drain(weights: Iterable[object], *, devices: frozenset[str], rank: int, version: int,
                started: float) -> TransferReport:
    """A non-sending actor rank still consumes its stream (gathering may be collective), validating it."""
    seen: set[str] = set()
    count = 0
    for count, item in enumerate(weights, start=1):
        validate_item(item, devices=devices, seen=seen)
        if count % 64 == 0:
            await asyncio.sleep(0)
    return TransferReport(role="actor", rank=rank, version=version, nbytes=0, tensors=count, buckets=0,
                          seconds=time.perf_counter() - started, digest="")


@dataclass
class Sending:
    """What a sender knows about one update, and what it counted so far."""

    transport: SenderTransport
    epoch: str
    version: int
    sender: int
    digest: UpdateDigest
    deadline: float
    delta: DeltaUpdate | None
    """This update's delta bookkeeping, or None when the sender keeps no version."""
    stripe: int = 0
    stripes: int = 1
    """This sender sends stripe ``stripe`` of ``stripes`` (:mod:`weightsync.core.transports.chain.stripes`): it plans
    every bucket (the stream is drained whole) and packs and publishes only its stripe's."""
    parts: list[PartSums] = field(default_factory=list)
    """The sums of every distinct part the receivers declared, folded as each bucket is packed (``PartsDigest``: a
    full update over host buckets from one sender; otherwise none, and every receiver checks the whole digest)."""
    buckets: int = 0
    """Buckets planned so far (every stripe's): the next bucket's index."""
    planned: int = 0
    """Tensors planned so far (every stripe's)."""
    nbytes: int = 0
    tensors: int = 0
    wire: int = 0
    pack_seconds: float = 0.0
    publish_seconds: float = 0.0
    headers: codec.UpdateHeaders = field(init=False)
    """This update's header fields, and its headers."""

    def __post_init__(self) -> None:
        base, base_model = (self.delta.base, self.delta.base_model) if self.delta is not None else (-1, "")
        self.headers = codec.UpdateHeaders(epoch=self.epoch, version=self.version, sender=self.sender, base=base,
                                           base_model=base_model)

    def report(self, started: float) -> TransferReport:
        delta = self.delta
        return TransferReport(
            role="actor", rank=self.sender, version=self.version, nbytes=self.nbytes, tensors=self.tensors,
            buckets=self.buckets, seconds=time.perf_counter() - started, digest=self.digest.hexdigest(),
            sender=self.sender, phases=(PhaseTiming(phase="pack", seconds=self.pack_seconds),
                                        PhaseTiming(phase="publish", seconds=self.publish_seconds)),
            wire_bytes=self.wire, changed_bytes=delta.changed if delta is not None else 0,
            base=delta.base if delta is not None else -1,
        )


@dataclass
class SendPipeline:
    """One sender's pipeline over the transport of the current epoch. Its threads are the engine's to shut down."""

    settings: EngineSettings
    devices: frozenset[str]
    policy: DevicePolicy
    tracer: Tracer
    pack_pool: concurrent.futures.ThreadPoolExecutor
    transfer_pool: concurrent.futures.ThreadPoolExecutor
    digest_pool: concurrent.futures.ThreadPoolExecutor
    """Delta updates: compares half of each large bucket beside the pack thread, and sums a kept bucket rewritten
    whole while the pack thread packs the next one."""
    bounce: HostBounce | None = None
    """Made at the first bucket with accelerator pieces bound for a host transport, then kept with the engine."""
    uploads: Upload | None = None
    """Made at the first bucket with host pieces bound for a device transport, then kept with the engine."""
    delta: SenderDelta = field(default_factory=SenderDelta)
    """With ``settings.delta``: the last version this sender sent, kept on the host (the base of the next update)."""

    def delta_update(self, transport: SenderTransport, digest: UpdateDigest, parts: Sequence[PartLayout] = ()
                     ) -> DeltaUpdate | None:
        """This update's delta bookkeeping, or None when the sender keeps no version (``delta`` off, no compiled
        encoder, or a test hook that rewrites packed buckets; engines with buckets on a device refuse ``delta``).
        ``parts``: the receivers' distinct parts, whose part model digests it folds too."""
        if (not self.settings.delta or not native.compiled() or not transport.buffer(0).is_cpu
                or not digest.fusable or self.settings.after_pack is not None):
            return None
        return self.delta.begin(parts)

    async def send(self, transport: SenderTransport, weights: Iterable[object], *, epoch: str, version: int,
                   started: float, stripe: tuple[int, int] = (0, 1), parts: list[PartLayout] | None = None,
                   stream: StreamPlan = StreamPlan()) -> TransferReport:
        """Send one update; ``stripe``: (s, K), this sender's stripe of K (one sender of everything: (0, 1));
        ``parts``: the distinct parts the receivers declared; ``stream``: what the plan says the stream carries."""
        if stream.skip:
            weights = _leaving_out(weights, stream.skip)
        digest = self.policy.new_digest()
        sending = Sending(transport, epoch, version, self.settings.context.rank, digest,
                          time.monotonic() + self.settings.timeout,
                          self.delta_update(transport, digest, parts or ()) if stripe[1] == 1 else None,
                          stripe=stripe[0], stripes=stripe[1])
        if parts and transport.buffer(0).is_cpu and sending.headers.base < 0:
            sending.parts = [PartSums(part) for part in parts]
            # Folded as each bucket is packed (a stripe's sender: its stripe's buckets); the whole digest too, unless
            # no receiver verifies it.
            sending.digest = PartsDigest(sending.parts, whole=not stream.parts_only)
        # Block after block only where every receiver reads its part from the host (weightsync.core.wire.blocks),
        # in every update alike: a delta compares each bucket with the one before in the same layout.
        blocks = stream.blocked if stream.blocked and parts and transport.buffer(0).is_cpu else None
        in_flight: dict[int, asyncio.Future[float]] = {}
        try:
            await self._buckets(sending, weights, in_flight, blocks, stream.carry)
            model = await self._final(sending, in_flight)
        except BaseException as exc:
            await self.abort(sending, in_flight, reason=exc)
            if sending.delta is not None:
                await asyncio.get_running_loop().run_in_executor(None, sending.delta.settle_quietly)
            raise
        if sending.delta is None:
            return sending.report(started)
        self.delta.completed(sending.delta, version, model)  # every receiver acknowledged every bucket
        return dataclasses.replace(sending.report(started), model=model)

    async def _buckets(self, sending: Sending, weights: Iterable[object],
                       in_flight: dict[int, asyncio.Future[float]], blocked: Mapping[str, BlockPlan] | None,
                       carry: Mapping[str, Sequence[Box]]) -> None:
        """Plan, pack and publish every bucket of the update (at most one in flight per slot)."""
        loop, transport = asyncio.get_running_loop(), sending.transport
        planned = time.perf_counter()
        bounce_begun = False
        for bucket in plan_buckets(weights, bucket_bytes=self.settings.bucket_bytes, devices=self.devices,
                                   blocked=blocked, carry=carry):
            index = sending.buckets
            sending.planned += bucket.completed
            if stripe_of(index, sending.stripes) != sending.stripe:  # another sender's
                sending.buckets = index + 1
                continue
            self.tracer.span("plan", index, planned, time.perf_counter())
            if bucket.on_device and not bounce_begun and transport.buffer(0).is_cpu:
                self.begin_bounce(bucket)
                bounce_begun = True
            slot = (index // sending.stripes) % transport.slots
            previous = in_flight.pop(slot, None)
            if previous is not None:
                await previous
            header, length, seconds = await loop.run_in_executor(self.pack_pool, self.pack, sending, slot, bucket)
            sending.pack_seconds += seconds
            in_flight[slot] = loop.run_in_executor(
                self.transfer_pool, self.publish, transport, index, slot, length, header, sending.deadline)
            sending.buckets, sending.wire = index + 1, sending.wire + length
            sending.nbytes, sending.tensors = sending.nbytes + bucket.payload_bytes, sending.tensors + bucket.completed
            planned = time.perf_counter()
        if sending.planned == 0:
            raise WeightStreamError("the weights stream was empty: an update must carry at least one tensor")

    async def _final(self, sending: Sending, in_flight: dict[int, asyncio.Future[float]]) -> str:
        """Once every bucket is out: the final header (the digest, and a delta update's model digest, returned)."""
        for future in list(in_flight.values()):
            sending.publish_seconds += await future
        in_flight.clear()
        delta = sending.delta
        model = delta.model_digest(sending.buckets) if delta is not None else ""
        final = sending.headers.marker(index=sending.buckets, final=True, digest=sending.digest.hexdigest(),
                                       base=delta.base if delta is not None else -1, model=model,
                                       parts=[sums.sums() for sums in sending.parts],
                                       part_models=delta.part_models if delta is not None else [])
        sending.publish_seconds += await asyncio.get_running_loop().run_in_executor(
            self.transfer_pool, _timed, sending.transport.publish, NO_SLOT, 0, final, sending.deadline)
        return model

    def begin_bounce(self, bucket: PlannedBucket) -> None:
        """On the planning thread (whose current stream produced the weights), at an update's first device bucket."""
        device = next(source.device for _, source, _ in bucket.items if not source.is_cpu)
        if self.bounce is None:
            self.bounce = HostBounce(device, bucket_bytes=self.settings.bucket_bytes)
        self.bounce.begin()

    def publish(self, transport: SenderTransport, index: int, slot: int, nbytes: int, header: bytes,
                deadline: float) -> float:
        started = time.perf_counter()
        transport.publish(slot, nbytes, header, deadline)
        ended = time.perf_counter()
        self.tracer.span("transfer", index, started, ended)
        return ended - started

    def pack(self, sending: Sending, slot: int, bucket: PlannedBucket) -> tuple[bytes, int, float]:
        """Copy the update's next bucket into ``slot`` (or, in a delta update, what changed in it) and fold it into
        the digest; returns the bucket's header, the bytes to publish and the seconds it took."""
        transport, digest, index = sending.transport, sending.digest, sending.buckets
        with self.policy.packing(transport, slot, bucket):
            transport.wait_slot(slot, sending.deadline)
            started = time.perf_counter()
            buffer = transport.buffer(slot)
            if bucket.on_device and buffer.is_cpu and self.bounce is not None:
                bucket = self.bounce.bounce(bucket, sending.deadline)
            metas = [item[0] for item in bucket.items]
            table = codec.encode_tensors(metas)
            if isinstance(digest, PartsDigest):  # what each part's receivers will read of the bucket
                digest.pieces(metas)
            after_pack = self.settings.after_pack
            length, dense = bucket.nbytes, -1
            if sending.delta is not None:
                length, dense = sending.delta.pack(buffer, bucket, table, digest, index=index, pool=self.digest_pool)
            elif after_pack is None and digest.fusable and buffer.is_cpu and not bucket.on_device:
                digest.begin_bucket(table, bucket.nbytes)
                pack_hashing(buffer.data_ptr(), bucket, digest)
            elif after_pack is None and not buffer.is_cpu and (device := self.policy.accelerator()) is not None and (
                    not bucket.on_device or any(source.is_cpu for _, source, _ in bucket.items)):
                self.upload(device, buffer, bucket, table, sending)
            else:
                for item in bucket.items:
                    pack_piece(buffer, bucket, item)
                payload = buffer[: bucket.nbytes]
                if after_pack is not None:
                    after_pack(index, payload)  # a test hook: the bytes are hashed after it, as they stand
                digest.update_bucket(table, payload)
            header = sending.headers.bucket(index=index, slot=slot, nbytes=length, table=table, dense=dense)
        self.tracer.span("pack", index, started, time.perf_counter())
        return header, length, time.perf_counter() - started

    def upload(self, device: tuple[AcceleratorOps, Any], buffer: torch.Tensor, bucket: PlannedBucket, table: bytes,
               sending: Sending) -> None:
        """Host pieces into a device bucket through a pinned host bucket
        (:class:`~weightsync.core.pipeline.bounce.Upload`): a bucket wholly from the host is hashed from the pinned
        bytes as they are copied, a mixed one afterwards."""
        ops, stream = device
        if self.uploads is None:
            self.uploads = Upload(ops, bucket_bytes=self.settings.bucket_bytes)
        host = self.uploads.take(sending.deadline)
        digest, host_digest = sending.digest, sending.digest.host()
        if not bucket.on_device and host_digest.fusable:
            host_digest.begin_bucket(table, bucket.nbytes)
            pack_hashing(host.data_ptr(), bucket, host_digest)
            self.uploads.send(buffer, bucket, stream)
            return
        base = host.data_ptr()
        for meta, source, start in bucket.items:
            if meta.nbytes and source.is_cpu:
                copy_stream(base + meta.bucket_offset, source.data_ptr() + start, meta.nbytes)
        self.uploads.send(buffer, bucket, stream)
        digest.update_bucket(table, buffer[: bucket.nbytes])

    async def abort(self, sending: Sending, in_flight: dict[int, asyncio.Future[float]], *,
                    reason: BaseException) -> None:
        """Tell receivers the update is off, so they fail now instead of at their deadline. Best effort."""
        message = f"{type(reason).__name__}: {reason}"[:500] or "aborted"
        loop = asyncio.get_running_loop()
        # Queued behind in-flight publishes on the same thread, so receivers see it after what was already sent.
        future = loop.run_in_executor(
            self.transfer_pool, _timed, sending.transport.publish, NO_SLOT, 0,
            sending.headers.marker(index=sending.buckets, abort=message),
            time.monotonic() + min(self.settings.timeout, 10.0))
        pending = [*in_flight.values(), future]
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending, return_exceptions=True)), 15.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass


def _leaving_out(weights: Iterable[object], skip: frozenset[str]) -> Iterator[object]:
    """``weights`` less the pairs whose name is in ``skip`` (anything else, malformed items included, goes on to
    the planner, which says what is wrong with it)."""
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and item[0] in skip):
            yield item


def _timed(function: Any, *args: Any) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started
