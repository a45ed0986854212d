"""The sender's half of the pipeline: plan → pack → publish, double-buffered, and the abort that tells receivers.

The weights stream is planned into buckets on the event loop's thread (cheap bookkeeping); packing bucket k+1 into
slot (k+1) % slots runs on a packing thread while bucket k is published on a transfer thread. Planning and packing
take turns rather than overlap: both are Python for small tensors, and two threads contending for the GIL around
every copy cost more than they save.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.api.errors import WeightStreamError
from weightsync.api.types import StageTiming, TransferReport
from weightsync.core import codec, delta, tensors
from weightsync.core.device import AcceleratorPolicy
from weightsync.core.digest import UpdateDigest
from weightsync.core.planner import PIECE_BYTES, PlannedBucket, piece_bytes, plan_buckets, validate_pair
from weightsync.core.settings import EngineSettings
from weightsync.core.staging import SendStaging, Upload
from weightsync.core.tensors import copy_batch, copy_stream
from weightsync.core.trace import Tracer
from weightsync.core.transport import NO_SLOT, DevicePolicy, SenderTransport

__all__ = ["SendPipeline", "drain"]


async def drain(weights: Iterable[object], *, devices: frozenset[str], rank: int, version: int,
                started: float) -> TransferReport:
    """A non-sending actor rank still consumes its stream (gathering may be collective), validating it."""
    seen: set[str] = set()
    count = 0
    for count, item in enumerate(weights, start=1):
        validate_pair(item, devices=devices, seen=seen)
        if count % 64 == 0:
            await asyncio.sleep(0)
    return TransferReport(role="actor", rank=rank, version=version, nbytes=0, tensors=count, buckets=0,
                          seconds=time.perf_counter() - started, digest="")


def _settle_quietly(update: _DeltaUpdate) -> None:
    """After a failed update: its folds finish before anything changes the kept copy; their errors do not matter."""
    try:
        update.settled()
    except Exception:  # noqa: BLE001 - the update failed already; its model digest is discarded
        pass


@dataclass
class _DeltaUpdate:
    """One update of a sender that keeps its last version (``SyncConfig.delta``): against which base it encodes,
    and what it counted."""

    kept: delta.BaseCopies
    base: int
    """The base version of this update's deltas, -1 for a full update (the kept copy is then rewritten)."""
    base_model: str
    changed: int = 0
    folding: list[tuple[bytes, int, concurrent.futures.Future[int]]] = field(default_factory=list)
    """Each bucket's table, size and keyed sum, in order: known for a bucket sent as changes (its kept sum updated
    by what changed), else being summed from the kept copy on the digest thread."""

    def fold(self, pool: concurrent.futures.ThreadPoolExecutor, index: int, bucket: PlannedBucket, table: bytes,
             kept: delta.BucketCopy) -> None:
        """Fold ``kept`` (final for this version) into the model digest: its sum now when known, else on ``pool``
        while the next bucket is packed."""
        future: concurrent.futures.Future[int]
        if kept.total is not None:
            future = concurrent.futures.Future()
            future.set_result(kept.total)
        else:
            future = pool.submit(kept.sum, index, [meta for meta, _, _ in bucket.items])
        self.folding.append((table, kept.nbytes, future))

    def model_digest(self) -> str:
        """Once every bucket is folded: the model digest."""
        model = delta.ModelDigest()
        for table, nbytes, future in self.folding:
            model.add(table, nbytes, future.result())
        self.folding = []
        return model.hexdigest()

    def settled(self) -> None:
        """Wait for the sums under way (no kept bucket may change or go while one reads it); raises a sum's error."""
        folding, self.folding = self.folding, []
        for _, _, future in folding:
            future.result()


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
    staging: SendStaging | None = None
    """Made at the first bucket with accelerator pieces bound for a host transport, then kept with the engine."""
    uploads: Upload | None = None
    """Made at the first bucket with host pieces bound for a device transport, then kept with the engine."""
    kept: delta.BaseCopies = field(default_factory=delta.BaseCopies)
    """With ``settings.delta``: the last version this sender sent, on the host (the base of the next update)."""
    allowed_base: int | None = None
    """The version every receiver holds, as the manager said at ``init_process_group`` (advanced by every update
    this epoch completes); None: send the next update full."""

    def delta_update(self, transport: SenderTransport, digest: UpdateDigest) -> _DeltaUpdate | None:
        """This update's delta bookkeeping, or None when the sender keeps no version (``delta`` off, no compiled
        encoder, or a test hook that rewrites packed buckets; engines with buckets on a device refuse ``delta``). A
        delta against the kept version only when every receiver holds it."""
        if (not self.settings.delta or tensors._HELPER is None or not transport.buffer(0).is_cpu
                or not digest.fusable or getattr(self.settings.hook, "after_pack", None) is not None):
            return None
        kept = self.kept
        usable = kept.version is not None and kept.version == self.allowed_base
        update = _DeltaUpdate(kept, kept.version if usable and kept.version is not None else -1,
                              kept.model if usable else "")
        kept.version = None  # changed bucket by bucket from here: holds no whole version until the update completes
        return update

    async def send(self, transport: SenderTransport, weights: Iterable[object], *, epoch: str, version: int,
                   started: float) -> TransferReport:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.settings.timeout
        digest = self.policy.new_digest()
        in_flight: dict[int, asyncio.Future[float]] = {}
        pack_seconds = publish_seconds = 0.0
        index = nbytes = tensors = wire = 0
        update = self.delta_update(transport, digest)
        try:
            planned = time.perf_counter()
            staging_begun = False
            for bucket in plan_buckets(weights, bucket_bytes=self.settings.bucket_bytes, devices=self.devices):
                self.tracer.span("plan", index, planned, time.perf_counter())
                if bucket.on_device and not staging_begun and transport.buffer(0).is_cpu:
                    self.begin_staging(bucket)
                    staging_begun = True
                slot = index % transport.slots
                previous = in_flight.pop(slot, None)
                if previous is not None:
                    await previous
                header, length, seconds = await loop.run_in_executor(
                    self.pack_pool, self.pack, transport, slot, index, bucket, version, epoch, digest, deadline,
                    update)
                pack_seconds += seconds
                in_flight[slot] = loop.run_in_executor(
                    self.transfer_pool, self.publish, transport, index, slot, length, header, deadline)
                index, nbytes, tensors = index + 1, nbytes + bucket.payload_bytes, tensors + bucket.completed
                wire += length
                planned = time.perf_counter()
            if tensors == 0:
                raise WeightStreamError("the weights stream was empty: an update must carry at least one tensor")
            for future in list(in_flight.values()):
                publish_seconds += await future
            in_flight.clear()
            model = ""
            if update is not None:
                model = update.model_digest()
                update.kept.truncate(index)
            final = codec.BucketHeader(
                wire=codec.WIRE_VERSION, epoch=epoch, version=version, sender=self.settings.context.rank,
                index=index, slot=NO_SLOT, nbytes=0, tensors=[], final=True, digest=digest.hexdigest(),
                base=update.base if update is not None else -1, model=model)
            publish_seconds += await loop.run_in_executor(
                self.transfer_pool, _timed, transport.publish, NO_SLOT, 0, codec.encode(final), deadline)
        except BaseException as exc:
            await self.abort(transport, in_flight, epoch=epoch, version=version, index=index, reason=exc)
            if update is not None:
                await loop.run_in_executor(None, _settle_quietly, update)
            raise
        if update is not None:  # every receiver acknowledged every bucket: the kept copy is this version now
            update.kept.version, update.kept.model = version, model
            self.allowed_base = version
        rank = self.settings.context.rank
        return TransferReport(
            role="actor", rank=rank, version=version, nbytes=nbytes, tensors=tensors, buckets=index,
            seconds=time.perf_counter() - started, digest=digest.hexdigest(), sender=rank,
            stages=(StageTiming(stage="pack", seconds=pack_seconds),
                    StageTiming(stage="publish", seconds=publish_seconds)),
            wire_bytes=wire, changed_bytes=update.changed if update is not None else 0,
            base=update.base if update is not None else -1,
        )

    def begin_staging(self, bucket: PlannedBucket) -> None:
        """On the planning thread (whose current stream produced the weights), at an update's first device bucket."""
        device = next(source.device for _, source, _ in bucket.items if not source.is_cpu)
        if self.staging is None:
            self.staging = SendStaging(device, bucket_bytes=self.settings.bucket_bytes)
        self.staging.begin()

    def publish(self, transport: SenderTransport, index: int, slot: int, nbytes: int, header: bytes,
                deadline: float) -> float:
        started = time.perf_counter()
        transport.publish(slot, nbytes, header, deadline)
        ended = time.perf_counter()
        self.tracer.span("transfer", index, started, ended)
        return ended - started

    def pack(self, transport: SenderTransport, slot: int, index: int, bucket: PlannedBucket, version: int,
             epoch: str, digest: UpdateDigest, deadline: float, update: _DeltaUpdate | None = None
             ) -> tuple[bytes, int, float]:
        """Copy ``bucket``'s pieces into ``slot`` (or, in a delta update, what changed in them) and fold them into the
        digest; returns the bucket's header and the bytes to publish."""
        with self.policy.packing(transport, slot, bucket):
            transport.wait_slot(slot, deadline)
            started = time.perf_counter()
            buffer = transport.buffer(slot)
            if bucket.on_device and buffer.is_cpu and self.staging is not None:
                bucket = self.staging.stage(bucket, deadline)
            table = codec.encode_tensors([item[0] for item in bucket.items])
            after_pack = getattr(self.settings.hook, "after_pack", None)
            if update is not None:
                header, length = self.pack_delta(update, buffer, bucket, table, digest, epoch=epoch, version=version,
                                                 index=index, slot=slot)
                self.tracer.span("pack", index, started, time.perf_counter())
                return header, length, time.perf_counter() - started
            if after_pack is None and digest.fusable and buffer.is_cpu and not bucket.on_device:
                digest.begin_bucket(table, bucket.nbytes)
                pack_hashing(buffer.data_ptr(), bucket, digest)
            elif after_pack is None and not buffer.is_cpu and isinstance(self.policy, AcceleratorPolicy) and (
                    not bucket.on_device or any(source.is_cpu for _, source, _ in bucket.items)):
                self.upload(self.policy, buffer, bucket, table, digest, deadline)
            else:
                for item in bucket.items:
                    meta = item[0]
                    if meta.nbytes:
                        buffer[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece_bytes(item))
                payload = buffer[: bucket.nbytes]
                if after_pack is not None:
                    after_pack(index, payload)  # a test hook: the bytes are hashed after it, as they stand
                digest.update_bucket(table, payload)
            header = codec.encode_bucket(epoch=epoch, version=version, sender=self.settings.context.rank,
                                         index=index, slot=slot, nbytes=bucket.nbytes, table=table)
        self.tracer.span("pack", index, started, time.perf_counter())
        return header, bucket.nbytes, time.perf_counter() - started

    def pack_delta(self, update: _DeltaUpdate, buffer: torch.Tensor, bucket: PlannedBucket, table: bytes,
                   digest: UpdateDigest, *, epoch: str, version: int, index: int, slot: int) -> tuple[bytes, int]:
        """A bucket of a sender that keeps its version (host buffer, host pieces): its changes against the kept
        bucket when that lines up and they are smaller than the bucket, else the bucket dense; either way the kept
        bucket becomes this version's and is folded into the model digest."""
        base, dense = buffer.data_ptr(), -1
        kept = update.kept.match(index, table, bucket.nbytes) if update.base >= 0 and bucket.nbytes else None
        length: int | None = None
        if kept is not None:
            rows = array.array("Q")
            kept_at = kept.data.data_ptr()
            for meta, source, start in bucket.items:
                rows.extend((source.data_ptr() + start, kept_at + meta.bucket_offset, meta.nbytes,
                             delta.unit_of(meta), delta.piece_key(index, meta.bucket_offset)))
            length, changed, sum_change = delta.encode(rows, base, bucket.nbytes - 1, self.digest_pool)
            update.changed += changed
            if kept.total is not None:
                kept.total = (kept.total + sum_change) & ((1 << 64) - 1)
        if kept is not None and length is not None:
            dense = bucket.nbytes
            digest.update_bucket(table, buffer[:length])
        else:
            length = bucket.nbytes
            digest.begin_bucket(table, bucket.nbytes)
            pack_hashing(base, bucket, digest)
            if kept is None:  # the kept bucket is rewritten from the packed one (its padding stays zero)
                kept = update.kept.replace(index, table, bucket.nbytes)
                copy_batch([item for meta, _, _ in bucket.items for item in (meta.bucket_offset, meta.bucket_offset,
                                                                             meta.nbytes)],
                           kept.data.data_ptr(), base)
                update.changed += bucket.payload_bytes
        update.fold(self.digest_pool, index, bucket, table, kept)
        header = codec.encode_bucket(epoch=epoch, version=version, sender=self.settings.context.rank, index=index,
                                     slot=slot, nbytes=length, table=table, base=update.base,
                                     base_model=update.base_model, dense=dense)
        return header, length

    def upload(self, policy: AcceleratorPolicy, buffer: torch.Tensor, bucket: PlannedBucket, table: bytes,
               digest: UpdateDigest, deadline: float) -> None:
        """Host pieces into a device bucket through a pinned host bucket (:class:`~weightsync.core.staging.Upload`):
        a bucket wholly from the host is hashed from the pinned bytes as they are copied, a mixed one afterwards."""
        if self.uploads is None:
            self.uploads = Upload(policy.ops, bucket_bytes=self.settings.bucket_bytes)
        host = self.uploads.take(deadline)
        inner = getattr(digest, "inner", None)
        if not bucket.on_device and isinstance(inner, UpdateDigest) and inner.fusable:
            inner.begin_bucket(table, bucket.nbytes)
            pack_hashing(host.data_ptr(), bucket, inner)
            self.uploads.send(buffer, bucket, policy.copy_stream)
            return
        base = host.data_ptr()
        for meta, source, start in bucket.items:
            if meta.nbytes and source.is_cpu:
                copy_stream(base + meta.bucket_offset, source.data_ptr() + start, meta.nbytes)
        self.uploads.send(buffer, bucket, policy.copy_stream)
        digest.update_bucket(table, buffer[: bucket.nbytes])

    async def abort(self, transport: SenderTransport, in_flight: dict[int, asyncio.Future[float]], *, epoch: str,
                    version: int, index: int, reason: BaseException) -> None:
        """Tell receivers the update is off, so they fail now instead of at their deadline. Best effort."""
        message = f"{type(reason).__name__}: {reason}"[:500] or "aborted"
        header = codec.BucketHeader(
            wire=codec.WIRE_VERSION, epoch=epoch, version=version, sender=self.settings.context.rank, index=index,
            slot=NO_SLOT, nbytes=0, tensors=[], abort=message)
        loop = asyncio.get_running_loop()
        # Queued behind in-flight publishes on the same thread, so receivers see it after what was already sent.
        future = loop.run_in_executor(
            self.transfer_pool, _timed, transport.publish, NO_SLOT, 0, codec.encode(header),
            time.monotonic() + min(self.settings.timeout, 10.0))
        pending = [*in_flight.values(), future]
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending, return_exceptions=True)), 15.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass


def pack_hashing(base: int, bucket: PlannedBucket, digest: UpdateDigest) -> None:
    """Copy host sources into the host bucket at ``base``, hashing the bucket in order (padding included)."""
    copy_batch(bucket.copies, base, 0)  # every small piece in one call
    hashed = 0
    for meta, source, start in bucket.large:
        nbytes, at = meta.nbytes, meta.bucket_offset
        digest.update_at(base + hashed, at - hashed)  # the small pieces and padding before this one
        address = source.data_ptr() + start
        for done in range(0, nbytes, PIECE_BYTES):
            size = min(PIECE_BYTES, nbytes - done)
            # Streamed into the bucket, so the bucket's copy is not in cache: the source's, just read, is, and holds
            # the same bytes (a receiver hashing the bucket checks this copy too).
            copy_stream(base + at + done, address + done, size)
            digest.update_at(address + done, size)
        hashed = at + nbytes
    digest.update_at(base + hashed, bucket.nbytes - hashed)


def _timed(function: Any, *args: Any) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started
