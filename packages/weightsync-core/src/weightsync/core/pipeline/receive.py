"""The receiver's half of the pipeline: a receive thread pulls buckets off the transport, checks their headers and
queues them; the consumer reads each bucket (:mod:`weightsync.core.pipeline.unpack`) and releases it once past it.

A host bucket is hashed by the consumer's side right behind its reads, piece by piece, while the bytes are still in
the core's cache; a device bucket is hashed whole by the receive thread (its digest stages it to the host).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Mapping

import torch

from weightsync.api.errors import DigestMismatchError, TransferError, WireError
from weightsync.api.types import PhaseTiming, TransferReport
from weightsync.core.delta.receiver import ReceiverDelta
from weightsync.core.delta.sources import SourcesDelta
from weightsync.core.pipeline.gather import Gathers
from weightsync.core.pipeline.handover import Hold
from weightsync.core.pipeline.trace import Tracer
from weightsync.core.pipeline.unpack import BucketReader, BulkPlans, whole_only
from weightsync.core.transports.settings import EngineSettings
from weightsync.core.transports.seam import Arrived
from weightsync.core.transports.seam import ReceivedBucket, ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.destinations import Fallback
from weightsync.core.wire.parts import PartLayout, check_sums

__all__ = ["BucketOrder", "ReceiveStream", "ReceiveContext"]


class ReceiveContext:
    """What every stream of one engine shares: settings, the epoch, caches of tables seen before, threads, the
    buffers tensors that arrive in pieces are gathered in."""

    def __init__(self, settings: EngineSettings, *, tracer: Tracer, pool: concurrent.futures.ThreadPoolExecutor
                 ) -> None:
        self.settings = settings
        self.tracer = tracer
        self.pool = pool
        self.tables = codec.TableCache()
        """Bucket tables received and validated before: a model's next update repeats them."""
        self.plans = BulkPlans()
        self.gather = Gathers()
        """Where a tensor that arrives in pieces is gathered for its view, kept across updates (faulted in once)."""
        self.delta: ReceiverDelta | SourcesDelta | None = (
            ReceiverDelta(verify_every=settings.verify_every) if settings.delta else None)
        """With ``settings.delta``: what this receiver holds across updates (``weightsync.core.delta.receiver``; per
        sender from a sharded ``actor_wg``: ``weightsync.core.delta.sources``)."""

    def begin_delta(self, sources: bool, part: PartLayout | None = None) -> None:
        """An update from one sender or from several (``sources``) begins. Between the two kinds nothing held
        carries over: the first update after a switch must be full (a delta one is refused before any write).
        ``part``: this worker's, which a copy kept for its views holds alone (from one sender; from several it
        only says which block of a tensor packed block after block a host copy hands over)."""
        if self.delta is None:
            return
        if isinstance(self.delta, SourcesDelta) != sources:
            every = self.settings.verify_every
            self.delta = SourcesDelta(verify_every=every) if sources else ReceiverDelta(verify_every=every)
        self.delta.begin(part)


class ReceiveStream:
    """The ``ReceivedWeights`` of one update (see the Protocol for the view-validity contract)."""

    def __init__(self, context: ReceiveContext, transport: ReceiverTransport, hold: Hold, *, epoch: str,
                 peer: str, reader: BucketReader, release_early: bool = True) -> None:
        self.report: TransferReport | None = None
        self._context, self._transport, self._hold, self._reader = context, transport, hold, reader
        self._release_early = release_early
        """Whether releasing a bucket before it is read frees anything (a staged replay's releases free nothing)."""
        self._epoch, self._peer = epoch, peer
        self._queue: asyncio.Queue[Arrived | BaseException] | None = None
        self._started = time.perf_counter()
        self._receive_seconds = 0.0
        self._unpack_seconds = 0.0
        """The consumer's seconds with a bucket current (reading, copying and hashing it), every bucket's."""
        self._nbytes = self._buckets = self._wire = self._delta_buckets = 0
        self._finished = False
        self._unpack_started = 0.0
        self._destinations: Mapping[str, torch.Tensor] | None = None
        """Where the consumer reads the current bucket to: its ``copy_into`` destinations, or None for views."""
        self._fallback: Fallback | None = None
        self._shards: Mapping[str, torch.Tensor] | None = None
        """A worker of a part's own ``copy_into`` destinations in delta updates, among them its shards (the delta
        receiver writes changes straight into a shard where it can: ``ReceiverDelta.take``)."""
        self._patched: Arrived | None = None
        self._applied: Arrived | None = None
        self._in_transit: collections.deque[Arrived] = collections.deque()
        """Buckets handed to the consumer's loop and not yet taken there (``_deliver``), oldest first."""
        self._in_transit_lock = threading.Lock()

    def __aiter__(self) -> ReceiveStream:
        return self

    @property
    def wrote(self) -> bool:
        """Whether ``copy_into`` began writing to the consumer's destinations or calling its fallback (so that
        ``EngineHost`` can tell a failure that left the model as it was, whatever failed)."""
        delta = self._context.delta
        return self._reader.wrote or (delta is not None and self._queue is not None and delta.wrote)

    async def _start(self) -> asyncio.Queue[Arrived | BaseException]:
        if self._queue is None:
            await self._hold.start()
            part = self._reader.part
            self._context.begin_delta(self._reader.sources, part.layout if part is not None else None)
            loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            loop.run_in_executor(self._context.pool, self._receive_loop, loop, self._queue)
        return self._queue

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        views = await self._views(whole_bucket=False)
        if not views:
            raise StopAsyncIteration
        return views[0]

    async def next_batch(self) -> list[tuple[str, torch.Tensor]] | None:
        """What is left of the current bucket, or the next bucket's tensors (``BatchedWeights``)."""
        return await self._views(whole_bucket=True) or None

    async def _views(self, *, whole_bucket: bool) -> list[tuple[str, torch.Tensor]]:
        """The next view, or every view left in the bucket — up to a tensor gathered from one sender's buckets, which
        ends a batch (the next split tensor is gathered in the same buffer); [] at the end of the update. The views
        handed out before are no longer valid: their gather buffers are free again."""
        if self._finished:
            return []
        self._reader.gather.recycle()
        self._destinations = self._fallback = self._shards = None
        views: list[tuple[str, torch.Tensor]] = []
        try:
            while True:
                if self._reader.pending and self._patch():
                    ready = self._reader.next_view()
                    if ready is not None:
                        views.append(ready)
                        if not whole_bucket or self._reader.gathered:  # the next piece may overwrite it
                            return views
                    continue
                if views or not await self._advance():
                    return views
        except BaseException:
            self._close()
            raise

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Fallback | None = None,
    ) -> int:
        """The rest of the stream, copied straight from the receive buffers into ``destinations`` (see the Protocol
        and :mod:`weightsync.core.pipeline.unpack`)."""
        if self._finished:
            return 0
        count = 0
        self._destinations, self._fallback, self._shards = destinations, fallback, None
        part = self._reader.part
        if part is not None and self._context.delta is not None:
            # Delta updates write whole tensors: a shard the changes cannot go straight into has its tensor kept
            # whole by the delta receiver (as one the fallback takes), handed, brought up to date, to a fallback that
            # takes the shard's box of it.
            self._destinations, self._fallback = whole_only(destinations, fallback, part.layout)
            self._shards = destinations
        try:
            while True:
                if self._reader.pending:
                    if self._patch():
                        count += self._reader.copy_out(*((destinations, fallback) if self._reader.by_part else
                                                         (self._destinations, self._fallback)))
                    else:
                        count += self._reader.skip_applied()
                    continue
                if not await self._advance():
                    return count
        except BaseException:
            self._close()
            raise

    def _patch(self) -> bool:
        """Hand a bucket of a delta update to the delta receiver (once); False when that wrote it to the
        destinations whole."""
        current = self._reader.current
        if current is None or current.header.base < 0 or current is self._patched:
            return current is not self._applied
        self._patched = current
        if self._context.delta is None:
            raise TransferError(f"{self._peer} sent a delta update to a receiver without SyncConfig.delta",
                                peer=self._peer)
        early = self._transport if self._release_early else None
        if self._context.delta.take(current, self._destinations, self._fallback, transport=early,
                                    shards=self._shards):
            return True
        self._applied = current
        return False

    async def _advance(self) -> bool:
        """Finish the current bucket and make the next one current; False at the end of the update."""
        done = self._reader.finish()
        if done is not None:
            if self._context.delta is not None and done is not self._applied:
                self._context.delta.read(done, self._destinations, shards=self._shards)
            self._transport.release(done.token)
            ended = time.perf_counter()
            self._unpack_seconds += ended - self._unpack_started
            self._context.tracer.span("unpack", done.header.index, self._unpack_started, ended)
        arrived = await (await self._start()).get()
        if isinstance(arrived, BaseException):
            raise arrived
        header = arrived.header
        if header.abort:
            raise TransferError(f"{self._peer} aborted the update: {header.abort}", peer=self._peer)
        if header.final:
            self._complete(header)
            return False
        self._reader.begin(arrived)
        self._unpack_started = time.perf_counter()
        return True

    def _receive_loop(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Arrived | BaseException]) -> None:
        context, digest = self._context, self._reader.digest
        deadline = time.monotonic() + context.settings.timeout
        order = BucketOrder(self._reader.sources)
        fused: bool | None = None

        def deliver(item: Arrived | BaseException) -> None:
            with self._in_transit_lock:
                if self._finished:  # the consumer left (``_close``): acknowledged unread, here, in order
                    if isinstance(item, Arrived):
                        self._transport.release(item.token)
                    return
                if isinstance(item, Arrived):
                    self._in_transit.append(item)
            try:
                loop.call_soon_threadsafe(self._deliver, queue, item)
            except RuntimeError:  # the consumer's loop is closed: it never runs the callbacks of the buckets
                # still on their way to it, nor reads this one: released here, in order
                with self._in_transit_lock:
                    self._release_in_transit()

        try:
            while True:
                started = time.perf_counter()
                received: ReceivedBucket = self._transport.receive(deadline)
                header, table = codec.decode_bucket(received.header, epoch=self._epoch,
                                                    capacity=self._transport.capacity, cache=context.tables)
                if header.final or header.abort:
                    if header.final:
                        order.check_complete()
                    deliver(Arrived(header, received.payload, received.token))
                    return
                if order.take(header) == 0 and context.delta is not None:
                    context.delta.check_base(header, self._peer)
                payload = received.payload[: header.nbytes]
                after_receive = context.settings.after_receive
                if after_receive is not None:
                    after_receive(header.index, payload)
                if fused is None:  # one way for the whole update: the digest folds buckets in order
                    # (a delta update's buckets are hashed here: small, and read by the patch, not the consumer)
                    fused = self._reader.fuse(digest.fusable and payload.device.type == "cpu" and header.base < 0)
                if not fused:  # each bucket into its sender's digest (the consumer selects for itself)
                    digest.of(header.sender).update_bucket(table, payload)
                context.tracer.span("receive", header.index, started, time.perf_counter())
                self._receive_seconds += time.perf_counter() - started
                self._nbytes += sum(meta.nbytes for meta in header.tensors)
                self._wire += header.nbytes
                self._delta_buckets += header.dense >= 0
                self._buckets += 1
                deliver(Arrived(header, payload, received.token, table, fused))
        except BaseException as exc:
            # This update is lost on this rank. Closing the transport now tells the peers (an upstream waiting for
            # our acknowledgement, a downstream waiting for our announcement) at once instead of at their deadline;
            # the next update joins a new epoch with new connections anyway.
            self._transport.close()
            deliver(exc)
        finally:
            self._hold.release()

    def _deliver(self, queue: asyncio.Queue[Arrived | BaseException], item: Arrived | BaseException) -> None:
        """On the consumer's loop: hand ``item`` to the consumer, unless it left (then ``_close`` or the receive
        thread released it already)."""
        with self._in_transit_lock:  # releases stay in order with the receive thread's (see ``deliver``)
            if self._finished:
                return
            if isinstance(item, Arrived):
                if not self._in_transit or self._in_transit[0] is not item:
                    return  # released by the receive thread already (the loop was closed)
                self._in_transit.popleft()
        queue.put_nowait(item)

    def _release_in_transit(self) -> None:
        """Release the buckets on their way to the consumer's loop (the caller holds ``_in_transit_lock``)."""
        while self._in_transit:
            self._transport.release(self._in_transit.popleft().token)

    async def aclose(self) -> None:
        """The consumer stops early (its sink failed): the rest of the update is received and dropped."""
        self._close()

    def _complete(self, header: codec.BucketHeader) -> None:
        settings, part = self._context.settings, self._reader.part if self._reader.by_part else None
        digest = self._reader.digest.hexdigest() if part is None else header.digest
        try:
            if part is not None and settings.verify_digest:
                check_sums(part, header.parts, receiver=settings.context.rank, peer=self._peer)
            elif settings.verify_digest and header.digest != digest:
                raise DigestMismatchError(
                    f"rollout rank {settings.context.rank} received bytes whose digest {digest[:16]} differs from "
                    f"{self._peer}'s {header.digest[:16]}: the update was corrupted in transit",
                    receiver=settings.context.rank, expected=header.digest, actual=digest,
                )
            if self._context.delta is not None:
                self._context.delta.complete(header, receiver=settings.context.rank, peer=self._peer)
            self.report = TransferReport(
                role="rollout", rank=settings.context.rank, version=header.version, nbytes=self._nbytes,
                tensors=self._reader.tensors, buckets=self._buckets, seconds=time.perf_counter() - self._started,
                digest=digest, sender=header.sender,
                phases=(PhaseTiming(phase="receive", seconds=self._receive_seconds),
                        PhaseTiming(phase="unpack", seconds=self._unpack_seconds)),
                wire_bytes=self._wire, base=header.base, delta_buckets=self._delta_buckets,
                part=part.plan.index if part is not None else -1, part_bytes=part.nbytes if part is not None else -1,
            )
        finally:
            self._close()

    def _close(self) -> None:
        """The consumer is done, at the end or early. Every bucket it holds or has not taken yet is acknowledged
        now, oldest first, and the receive thread acknowledges the rest as it arrives: the sender (and every other
        receiver) finishes the update instead of waiting for this one until the deadline, even if the consumer's
        loop never runs again (a worker that drives its own loop one call at a time) or closes (``asyncio.run``)
        before the callbacks of buckets already on their way have run."""
        with self._in_transit_lock:
            if self._finished:
                return
            self._finished = True
            self._hold.finished = True
            current = self._reader.current
            self._reader.current = None
            if current is not None:
                self._transport.release(current.token)
            while self._queue is not None and not self._queue.empty():  # taken from _in_transit before the rest
                item = self._queue.get_nowait()
                if isinstance(item, Arrived):
                    self._transport.release(item.token)
            self._release_in_transit()
        self._hold.release()


class BucketOrder:
    """What a receiver checks of the order of an update's buckets: in order from 0 (a striped update's across its
    stripes); from several senders (``sources``: a sharded ``actor_wg``), each sender's in order from 0, and their
    ranges of each tensor in one layout (``TensorMeta.blocks``), adding up to the whole tensor, which each sender's
    digest alone cannot show."""

    def __init__(self, sources: bool) -> None:
        self._sources = sources
        self._next: dict[int, int] = {}
        self._arrived: dict[str, list[int]] | None = {} if sources else None
        """Per tensor: the bytes of it arrived, and its size."""
        self._layouts: dict[str, tuple[tuple[int, ...], int]] = {}
        """Per tensor: its layout, as the first sender of a range of it sent it, and that sender."""

    def take(self, header: codec.BucketHeader) -> int:
        """Check a bucket's place in its stream; returns it."""
        stream = header.sender if self._sources else 0
        index = self._next.get(stream, 0)
        if header.index != index:
            raise WireError(f"bucket {header.index} of actor rank {header.sender} arrived where bucket {index} was "
                            "expected")
        self._next[stream] = index + 1
        if self._arrived is not None:
            for meta in header.tensors:
                layout, sender = self._layouts.setdefault(meta.name, (meta.blocks, header.sender))
                if meta.blocks != layout:  # its ranges would land in another's layout: refused before any is written
                    raise WireError(f"actor rank {header.sender} sent {meta.name!r} {_layout(meta.blocks)} and actor "
                                    f"rank {sender} {_layout(layout)}: every sender's ranges of a tensor must be in "
                                    "one layout")
                self._arrived.setdefault(meta.name, [0, meta.total_nbytes])[0] += meta.nbytes
        return index

    def check_complete(self) -> None:
        """A ``WireError`` naming the first tensor whose ranges, every sender's together, are not the whole tensor
        (a sender sent less, or more, of it than the layout it declared)."""
        for name, (nbytes, total) in (self._arrived or {}).items():
            if nbytes != total:
                raise WireError(f"the senders sent {nbytes} bytes of {name!r}, which has {total}: their shards do not "
                                "add up to the tensor (a stream that differs from its rank's declared layout?)")


def _layout(blocks: tuple[int, ...]) -> str:
    """A tensor's layout on the wire, in words."""
    return f"block after block ({blocks[1]} blocks along dimension {blocks[0]})" if blocks else "in its own order"
