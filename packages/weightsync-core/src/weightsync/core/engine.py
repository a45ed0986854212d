"""``BucketCheckpointEngine``: the lifecycle and the double-buffered pipeline, written once for every backend.

A backend subclasses it and supplies only what is its own: ``build_topology`` (who sends to whom), optionally
``_prepare`` (endpoints and registrations to advertise), and ``_connect_sender`` / ``_connect_receiver`` (a
:class:`~weightsync.core.transport.SenderTransport` / ``ReceiverTransport`` for the epoch).

Sender pipeline: the weights stream is planned into buckets on the event loop thread (cheap bookkeeping); packing
bucket k+1 (copies into slot (k+1) % slots) runs on a packing thread while bucket k is published on a transfer
thread. Receiver pipeline: a receive thread pulls buckets and validates their headers while the consumer copies
tensors out of the previous bucket. Host copies run in ``PIECE_BYTES`` pieces with the digest folded in right behind
each piece, from whichever side of the copy is still in cache (device buckets are hashed whole, staged to the
host): small tensors in batches (``copy_batch``, one C call for many), larger ones streamed (``copy_stream``,
non-temporal stores). Both release the GIL, so the stages overlap.
"""

from __future__ import annotations

import abc
import array
import asyncio
import concurrent.futures
import functools
import importlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal

import torch

from weightsync.api.config import SyncConfig
from weightsync.api.protocols import ReceivedWeights
from weightsync.api.errors import (
    ConcurrentUpdateError,
    ConfigError,
    DestinationError,
    DigestMismatchError,
    LifecycleError,
    TopologyError,
    TransferError,
    WeightStreamError,
    WireError,
    reject_renamed_keywords,
)
from weightsync.api.types import (
    RankArgs,
    StageTiming,
    Topology,
    TransferReport,
    WorkerContext,
    WorkerMetadata,
    WorldMetadata,
)
from weightsync.core import codec
from weightsync.core.digest import UpdateDigest
from weightsync.core.codec import TensorMeta
from weightsync.core.planner import PIECE_BYTES, PlannedBucket, piece_bytes, plan_buckets, validate_pair
from weightsync.core.tensors import COMPLEX_NAMES, DTYPES, copy_batch, copy_columns, copy_stream, dtype_from_name
from weightsync.core.transport import NO_SLOT, ReceivedBucket, ReceiverTransport, SenderTransport, TransportHook

__all__ = [
    "BucketCheckpointEngine", "default_node_id", "load_transport_hook", "RankRole", "with_epoch", "PIECE_BYTES",
]

RankRole = Literal["sender", "receiver", "idle"]
_ROLES: dict[str, RankRole] = {"sender": "sender", "receiver": "receiver", "idle": "idle"}


@functools.cache
def default_node_id() -> str:
    """Identity of this host: hostname plus kernel boot id (two containers on one host differ by hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def load_transport_hook(spec: str | None) -> TransportHook | None:
    if spec is None:
        return None
    module_name, _, attribute = spec.partition(":")
    try:
        hook: TransportHook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"transport_hook {spec!r} cannot be loaded: {exc}") from None
    return hook


class BucketCheckpointEngine(abc.ABC):
    """Base of every weightsync engine; implements the ``CheckpointEngine`` Protocol over a transport.

    Options common to every backend: ``context`` (``WorkerContext``, from the host), ``slots`` (buckets per side;
    default ``default_slots``),
    ``timeout`` (seconds any single blocking wait may take), ``verify_digest``, ``transport_hook`` (tests only).
    Backends list their own options in ``option_names``; an unknown option is a ``ConfigError``.
    """

    name: ClassVar[str]
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    option_names: ClassVar[frozenset[str]] = frozenset()
    default_slots: ClassVar[int] = 2
    """Buckets per side when ``slots`` is not given."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Give every backend's ``build_topology`` the same runtime guard against the old calling conventions.

        mypy already rejects ``trainer_world_size=`` and positional calls; untyped callers get a ``TypeError`` that
        names the new keyword and ``weightsync migrate`` instead of Python's generic message. The wrapper keeps the
        original signature (``functools.wraps``), so introspection still sees keyword-only parameters.
        """
        super().__init_subclass__(**kwargs)
        declared = cls.__dict__.get("build_topology")
        if isinstance(declared, classmethod) and not getattr(declared.__func__, "_weightsync_guarded", False):
            setattr(cls, "build_topology", classmethod(_guard_build_topology(declared.__func__)))

    def __init__(
        self,
        *,
        bucket_bytes: int,
        context: WorkerContext | None = None,
        slots: int | None = None,
        timeout: float = 600.0,
        verify_digest: bool = True,
        transport_hook: str | None = None,
        **options: Any,
    ) -> None:
        reject_renamed_keywords(type(self).__name__, options)
        unknown = sorted(set(options) - self.option_names)
        if unknown:
            accepted = ", ".join(sorted(self.option_names)) or "none"
            raise ConfigError(f"{self.name} engine got unknown options {unknown}; its own options: {accepted}")
        SyncConfig(bucket_bytes=bucket_bytes, slots=slots)  # validates both, raising ConfigError
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.bucket_bytes = bucket_bytes
        self.slots = slots if slots is not None else self.default_slots
        self.timeout = float(timeout)
        self.verify_digest = verify_digest
        self.context = context or WorkerContext(role="actor", rank=0, node_id=default_node_id())
        self.options = options
        self._hook = load_transport_hook(transport_hook)
        self._epoch: str | None = None
        self._role: RankRole | None = None
        self._sender_rank = 0
        self._sender: SenderTransport | None = None
        self._receiver: ReceiverTransport | None = None
        self._busy = threading.Lock()
        self._claim = threading.Lock()
        """Guards the hand-over of ``_busy`` from a draining stream to the next one (``receive_weights``)."""
        self._draining: _ReceiveStream | None = None
        """A stream whose consumer left early while its receive thread still drops the rest of its update."""
        self._successor: _ReceiveStream | None = None
        """The stream waiting for ``_draining`` to finish before it starts."""
        self._tables = codec.TableCache()
        """Bucket tables received and validated before: a model's next update repeats them."""
        self._bulk_plans: dict[int, tuple[list[TensorMeta], _BulkPlan | None]] = {}
        self._bulk_entries = 0
        self._closed = False
        self.trace_events: list[dict[str, Any]] | None = None
        """When a list (``enable_tracing``), every pack/transfer/receive/unpack of a bucket is appended to it."""
        self._pack_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-pack")
        self._transfer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-xfer")

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def prepare(self) -> WorkerMetadata:
        self._check_open()
        metadata: WorkerMetadata = {
            "backend": self.name,
            "role": self.context.role,
            "rank": self.context.rank,
            "node_id": self.context.node_id,
            "host_ip": self.context.host_ip,
            "pid": os.getpid(),
            "bucket_bytes": self.bucket_bytes,
            "slots": self.slots,
        }
        metadata.update(self._prepare())
        return metadata

    def _prepare(self) -> WorkerMetadata:
        """Backend hook: allocate/reuse what peers must know about and return it (merged into the metadata)."""
        return {}

    @classmethod
    @abc.abstractmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology: ...

    def init_process_group(self, *, rank_args: RankArgs) -> None:
        self._check_open()
        role = _ROLES.get(str(rank_args.get("role")))
        epoch = rank_args.get("epoch")
        if role is None or not isinstance(epoch, str) or not epoch:
            raise TopologyError(f"{self.name}: rank_args need role sender/receiver/idle and an epoch, got {rank_args}")
        self._abandon_in_flight()
        self._disconnect()
        sender = rank_args.get("sender", 0)
        self._sender_rank = sender if isinstance(sender, int) else 0
        if role == "sender":
            self._sender = self._connect_sender(rank_args)
        elif role == "receiver":
            self._receiver = self._connect_receiver(rank_args)
        self._role = role
        self._epoch = epoch

    def _abandon_in_flight(self) -> None:
        """A new epoch supersedes an update still in flight here (its manager gave up on it: timeout, cancellation,
        a dead peer). Closing the transports makes its blocked transport calls fail now instead of at their
        deadline; then it releases the engine."""
        if not self._busy.locked():
            return
        self._disconnect()
        # A transport call already blocked (a collective that cannot be interrupted) ends at its own deadline, one
        # ``timeout`` at most; what follows it fails at once on the closed transport.
        wait = self.timeout + 5.0
        if not self._busy.acquire(timeout=wait):
            raise ConcurrentUpdateError(f"{self.name}: an abandoned update did not stop within {wait:g} s")
        self._busy.release()

    @abc.abstractmethod
    def _connect_sender(self, rank_args: RankArgs) -> SenderTransport: ...

    @abc.abstractmethod
    def _connect_receiver(self, rank_args: RankArgs) -> ReceiverTransport: ...

    def finalize(self) -> None:
        """Nothing of the pipeline outlives an update except buffers and connections, which are kept."""
        self._check_open()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._disconnect()
        self._release()
        self._pack_pool.shutdown(wait=False, cancel_futures=True)
        self._transfer_pool.shutdown(wait=False, cancel_futures=True)

    def _release(self) -> None:
        """Backend hook: free what ``_prepare`` allocated (segments, registrations, listening endpoints)."""

    def _disconnect(self) -> None:
        sender, receiver = self._sender, self._receiver
        self._sender = self._receiver = None
        self._epoch = None
        self._role = None
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError(f"{self.name} engine is closed")

    def _require(self, role: RankRole, what: str) -> None:
        self._check_open()
        if self._epoch is None:
            raise LifecycleError(f"{what} before init_process_group on this {self.name} engine")
        if role == "receiver" and self._role != "receiver":
            raise LifecycleError(f"{what} on a rank whose role in this topology is {self._role}")

    def enable_tracing(self) -> list[dict[str, Any]]:
        """Record Chrome-trace spans (``ph: X``, microseconds of CLOCK_MONOTONIC, shared by every process on the host)."""
        self.trace_events = []
        return self.trace_events

    def _trace(self, stage: str, index: int, start: float, end: float) -> None:
        if self.trace_events is not None:
            self.trace_events.append({
                "name": f"{stage} {index}", "cat": stage, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                "pid": f"{self.context.role} {self.context.rank}", "tid": threading.current_thread().name,
            })

    @property
    def epoch(self) -> str | None:
        return self._epoch

    @property
    def role(self) -> RankRole | None:
        return self._role

    # -- sending ---------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int = 0) -> TransferReport:
        self._require("sender", "send_weights")
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUpdateError(f"{self.name}: send_weights while another update is in flight")
        started = time.perf_counter()
        try:
            if self._role != "sender" or self._sender is None:
                return await self._drain(weights, version=version, started=started)
            return await self._send(self._sender, weights, version=version, started=started)
        finally:
            self._busy.release()

    async def _drain(self, weights: Iterable[object], *, version: int, started: float) -> TransferReport:
        """A non-sending actor rank still consumes its stream (gathering may be collective), validating it."""
        seen: set[str] = set()
        count = 0
        for count, item in enumerate(weights, start=1):
            validate_pair(item, devices=self.devices, seen=seen)
            if count % 64 == 0:
                await asyncio.sleep(0)
        return TransferReport(
            role="actor", rank=self.context.rank, version=version, nbytes=0, tensors=count, buckets=0,
            seconds=time.perf_counter() - started, digest="",
        )

    async def _send(
        self, transport: SenderTransport, weights: Iterable[object], *, version: int, started: float
    ) -> TransferReport:
        loop = asyncio.get_running_loop()
        epoch = self._epoch or ""
        deadline = time.monotonic() + self.timeout
        digest = self._new_digest()
        in_flight: dict[int, asyncio.Future[float]] = {}
        pack_seconds = 0.0
        index = nbytes = tensors = 0
        try:
            # Planning (this thread) and packing (the pack thread) take turns rather than overlap: both are Python
            # for small tensors, and two threads contending for the GIL around every memmove cost more than they
            # save (measured: the small mix 10% slower overlapped).
            planned = time.perf_counter()
            for bucket in plan_buckets(weights, bucket_bytes=self.bucket_bytes, devices=self.devices):
                self._trace("plan", index, planned, time.perf_counter())
                slot = index % transport.slots
                previous = in_flight.pop(slot, None)
                if previous is not None:
                    await previous
                header, seconds = await loop.run_in_executor(
                    self._pack_pool, self._pack, transport, slot, index, bucket, version, epoch, digest, deadline
                )
                pack_seconds += seconds
                in_flight[slot] = loop.run_in_executor(
                    self._transfer_pool, self._publish, transport, index, slot, bucket.nbytes, header, deadline
                )
                index += 1
                nbytes += bucket.payload_bytes
                tensors += bucket.completed
                planned = time.perf_counter()
            if tensors == 0:
                raise WeightStreamError("the weights stream was empty: an update must carry at least one tensor")
            publish_seconds = 0.0
            for future in list(in_flight.values()):
                publish_seconds += await future
            in_flight.clear()
            final = codec.BucketHeader(
                wire=codec.WIRE_VERSION, epoch=epoch, version=version, sender=self.context.rank, index=index,
                slot=NO_SLOT, nbytes=0, tensors=[], final=True, digest=digest.hexdigest(),
            )
            publish_seconds += await loop.run_in_executor(
                self._transfer_pool, _timed, transport.publish, NO_SLOT, 0, codec.encode(final), deadline
            )
        except BaseException as exc:
            await self._abort(transport, in_flight, epoch=epoch, version=version, index=index, reason=exc)
            raise
        return TransferReport(
            role="actor", rank=self.context.rank, version=version, nbytes=nbytes, tensors=tensors, buckets=index,
            seconds=time.perf_counter() - started, digest=digest.hexdigest(), sender=self.context.rank,
            stages=(StageTiming(stage="pack", seconds=pack_seconds),
                    StageTiming(stage="publish", seconds=publish_seconds)),
        )

    def _publish(self, transport: SenderTransport, index: int, slot: int, nbytes: int, header: bytes,
                 deadline: float) -> float:
        started = time.perf_counter()
        transport.publish(slot, nbytes, header, deadline)
        ended = time.perf_counter()
        self._trace("transfer", index, started, ended)
        return ended - started

    def _pack(
        self, transport: SenderTransport, slot: int, index: int, bucket: PlannedBucket, version: int, epoch: str,
        digest: UpdateDigest, deadline: float,
    ) -> tuple[bytes, float]:
        transport.wait_slot(slot, deadline)
        started = time.perf_counter()
        buffer = transport.buffer(slot)
        metas = [item[0] for item in bucket.items]
        table = codec.encode_tensors(metas)
        after_pack = getattr(self._hook, "after_pack", None)
        if after_pack is None and digest.fusable and buffer.device.type == "cpu" and (
            self.devices == _CPU_ONLY or all(source.device.type == "cpu" for _, source, _ in bucket.items)
        ):
            digest.begin_bucket(table, bucket.nbytes)
            _pack_hashing(buffer.data_ptr(), bucket, digest)
        else:
            for item in bucket.items:
                meta = item[0]
                if meta.nbytes:
                    buffer[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece_bytes(item))
            payload = buffer[: bucket.nbytes]
            if after_pack is not None:
                after_pack(index, payload)  # a test hook: the bytes are hashed after it, as they stand
            digest.update_bucket(table, payload)
        header = codec.encode_bucket(epoch=epoch, version=version, sender=self.context.rank, index=index, slot=slot,
                                     nbytes=bucket.nbytes, table=table)
        self._trace("pack", index, started, time.perf_counter())
        return header, time.perf_counter() - started

    async def _abort(
        self, transport: SenderTransport, in_flight: dict[int, asyncio.Future[float]], *, epoch: str, version: int,
        index: int, reason: BaseException,
    ) -> None:
        """Tell receivers the update is off, so they fail now instead of at their deadline. Best effort."""
        message = f"{type(reason).__name__}: {reason}"[:500] or "aborted"
        header = codec.BucketHeader(
            wire=codec.WIRE_VERSION, epoch=epoch, version=version, sender=self.context.rank, index=index,
            slot=NO_SLOT, nbytes=0, tensors=[], abort=message,
        )
        loop = asyncio.get_running_loop()
        # Queued behind in-flight publishes on the same thread, so receivers see it after what was already sent.
        future = loop.run_in_executor(
            self._transfer_pool, _timed, transport.publish, NO_SLOT, 0, codec.encode(header),
            time.monotonic() + min(self.timeout, 10.0),
        )
        pending = [*in_flight.values(), future]
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.gather(*pending, return_exceptions=True)), 15.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            pass

    # -- receiving -------------------------------------------------------------------------------------------------

    def receive_weights(self) -> ReceivedWeights:
        self._require("receiver", "receive_weights")
        if self._receiver is None:
            raise LifecycleError(f"{self.name}: receive_weights on a rank that is not connected as a receiver")
        with self._claim:
            if self._busy.acquire(blocking=False):
                return _ReceiveStream(self, self._receiver, owns_engine=True)
            if self._draining is None or self._successor is not None:
                raise ConcurrentUpdateError(f"{self.name}: receive_weights while another update is in flight")
            # The previous update's consumer left early and its rest is still being received and dropped: the new
            # stream takes the engine over once that is done, without blocking this (event-loop) thread meanwhile.
            self._successor = _ReceiveStream(self, self._receiver, owns_engine=False)
            return self._successor

    async def _take_over(self, stream: _ReceiveStream) -> None:
        """Wait (polling with back-off) until the draining stream releases the engine, then hold it for ``stream``."""
        limit = self.timeout + 5.0
        deadline = time.monotonic() + limit
        pause = 0.001
        try:
            while not self._busy.acquire(blocking=False):
                if time.monotonic() > deadline:
                    raise ConcurrentUpdateError(
                        f"{self.name}: the previous update, left early by its consumer, was still being received "
                        f"{limit:g} s later"
                    )
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
        finally:
            with self._claim:
                if self._successor is stream:
                    self._successor = None

    def _bulk_plan(self, tensors: list[TensorMeta]) -> _BulkPlan | None:
        """``_BulkPlan`` of a bucket's table, built once per table (the ``TableCache`` hands the same list back for
        every update that repeats it); None for a bucket it does not apply to."""
        cached = self._bulk_plans.get(id(tensors))
        if cached is not None and cached[0] is tensors:  # the list is held there: its identity is not reused
            return cached[1]
        plan = _BulkPlan.of(tensors)
        if self._bulk_entries + len(tensors) > _MAX_BULK_ENTRIES:
            self._bulk_plans.clear()
            self._bulk_entries = 0
        self._bulk_plans[id(tensors)] = (tensors, plan)
        self._bulk_entries += len(tensors)
        return plan

    def _new_digest(self) -> UpdateDigest:
        """Backend hook: the digest buckets are folded into (a device engine stages device payloads to host)."""
        return UpdateDigest()

    def _peer_name(self) -> str:
        return f"actor rank {self._sender_rank}"


def with_epoch(topology: Topology) -> Topology:
    """Stamp every rank's arguments with one fresh membership-epoch token (kept where already present).

    The token is born in ``build_topology`` on the driver and reaches workers only through ``init_process_group``'s
    arguments — the control plane — so it works whichever manager drives the lifecycle (ours or verl's). Every
    connection of ours must present it.
    """
    token = secrets.token_hex(16)
    return Topology(
        actor=[{"epoch": token, **args} for args in topology.actor],
        rollout=[{"epoch": token, **args} for args in topology.rollout],
        senders=topology.senders,
    )


def _guard_build_topology(function: Any) -> Any:
    @functools.wraps(function)
    def build_topology(cls: type, *args: Any, **kwargs: Any) -> Any:
        reject_renamed_keywords(f"{cls.__name__}.build_topology", kwargs)
        if args:
            raise TypeError(
                f"{cls.__name__}.build_topology takes keyword arguments only: "
                "build_topology(actor_wg_world_size=..., rollout_world_size=..., metadata=...)"
            )
        metadata = kwargs.get("metadata")
        if isinstance(metadata, WorldMetadata):
            for side, size_key in (("actor", "actor_wg_world_size"), ("rollout", "rollout_world_size")):
                size, got = kwargs.get(size_key), len(getattr(metadata, side))
                if size != got:
                    raise TopologyError(f"{cls.__name__}.build_topology: {size_key}={size} but metadata holds "
                                        f"{got} {side} entries")
        topology = function(cls, **kwargs)
        return with_epoch(topology) if isinstance(topology, Topology) else topology

    build_topology._weightsync_guarded = True  # type: ignore[attr-defined]
    return build_topology


_CPU_ONLY = frozenset({"cpu"})


def _pack_hashing(base: int, bucket: PlannedBucket, digest: UpdateDigest) -> None:
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


_MAX_BULK_ENTRIES = 1 << 18
"""Bound of the table entries behind an engine's cached ``_BulkPlan``s (cleared when full, like the TableCache)."""


class _BulkPlan:
    """A bucket of small pieces of real dtypes (the many-small-tensors case) in columns, for ``_copy_bulk``."""

    __slots__ = ("names", "dtypes", "shapes", "sources", "sizes", "offsets", "chunks", "completed")

    def __init__(self, tensors: list[TensorMeta]) -> None:
        self.names = [meta.name for meta in tensors]
        self.dtypes = [DTYPES[meta.dtype] for meta in tensors]
        self.shapes = [meta.shape for meta in tensors]
        self.sources = array.array("Q", [meta.bucket_offset for meta in tensors])
        self.sizes = array.array("Q", [meta.nbytes for meta in tensors])
        self.offsets = [(index, meta.offset) for index, meta in enumerate(tensors) if meta.offset] or None
        self.completed = sum(meta.offset + meta.nbytes == meta.total_nbytes for meta in tensors)
        # Where to hash: as ``_copy_out`` does, every time PIECE_BYTES or more were copied since the last hash.
        self.chunks: list[tuple[int, int, int]] = []
        start = hashed = 0
        for index, meta in enumerate(tensors):
            end = meta.bucket_offset + meta.nbytes
            if end - hashed >= PIECE_BYTES or index == len(tensors) - 1:
                self.chunks.append((start, index + 1, end))
                start, hashed = index + 1, end

    @classmethod
    def of(cls, tensors: list[TensorMeta]) -> _BulkPlan | None:
        if not tensors or any(meta.nbytes > PIECE_BYTES or meta.dtype in COMPLEX_NAMES for meta in tensors):
            return None
        return cls(tensors)


class _Arrived:
    __slots__ = ("header", "payload", "token", "table", "fused")

    def __init__(self, header: codec.BucketHeader, payload: torch.Tensor, token: int, table: bytes = b"",
                 fused: bool = False) -> None:
        self.header = header
        self.payload = payload
        self.token = token
        self.table = table
        self.fused = fused
        """The consumer hashes this bucket as it reads it (a host payload); else the receive thread hashed it."""


class _ReceiveStream:
    """The ``ReceivedWeights`` of one update (see the Protocol for the view-validity contract).

    A receive thread pulls buckets off the transport and queues them; the consumer's side yields views (or copies
    into destinations, ``copy_into``) and releases each bucket once it moved past it. A host bucket is hashed by
    the consumer's side right behind its reads, piece by piece, while the bytes are still in the core's cache; a
    device bucket is hashed whole by the receive thread (its digest stages it to the host).
    """

    def __init__(self, engine: BucketCheckpointEngine, transport: ReceiverTransport, *, owns_engine: bool) -> None:
        self.report: TransferReport | None = None
        self._engine = engine
        self._transport = transport
        self._queue: asyncio.Queue[_Arrived | BaseException] | None = None
        self._current: _Arrived | None = None
        self._position = 0
        self._hashed = 0
        self._scratch: torch.Tensor | None = None
        self._digest = engine._new_digest()
        self._started = time.perf_counter()
        self._receive_seconds = 0.0
        self._nbytes = 0
        self._tensors = 0
        self._buckets = 0
        self._finished = False
        self._abandoned = False
        self._unpack_started = 0.0
        # The engine is busy until both the consumer side (close) and the receive thread are done with it. A stream
        # born while another drains holds it only once ``_take_over`` got it. Counted under the engine's ``_claim``.
        self._holders = 1 if owns_engine else 0

    def __aiter__(self) -> _ReceiveStream:
        return self

    async def _start(self) -> asyncio.Queue[_Arrived | BaseException]:
        if self._queue is None:
            took_over = self._holders == 0
            if took_over:
                await self._engine._take_over(self)
            loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            with self._engine._claim:  # the consumer's hold (when taken over) and the receive thread's
                self._holders += 2 if took_over else 1
            loop.run_in_executor(self._engine._transfer_pool, self._receive_loop, loop, self._queue)
        return self._queue

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if self._finished:
            raise StopAsyncIteration
        try:
            while True:
                current = self._current
                if current is not None and self._position < len(current.header.tensors):
                    meta = current.header.tensors[self._position]
                    self._position += 1
                    if current.fused and meta.bucket_offset - self._hashed >= PIECE_BYTES:
                        # The consumer is done with every earlier piece: hash them while they are in cache.
                        self._hash_to(current, meta.bucket_offset)
                    ready = self._tensor(meta, current.payload)
                    if ready is not None:
                        return ready
                    continue
                if not await self._advance():
                    raise StopAsyncIteration
        except BaseException:
            self._close()
            raise

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Callable[[str, torch.Tensor], object] | None = None,
    ) -> int:
        """The rest of the stream, copied straight from the receive buffers into ``destinations`` (see the Protocol).

        A host destination of the tensor's dtype and shape, contiguous, is filled by raw copies in pieces (a large
        tensor streamed, ``copy_stream``), each piece of the bucket hashed right after it is copied; a piece of a
        tensor split across buckets lands at its offset directly (no reassembly buffer). Any other destination gets
        ``Tensor.copy_`` of the tensor's view.
        """
        if self._finished:
            return 0
        count = 0
        try:
            while True:
                current = self._current
                if current is not None and self._position < len(current.header.tensors):
                    count += self._copy_out(current, destinations, fallback)
                    continue
                if not await self._advance():
                    return count
        except BaseException:
            self._close()
            raise

    async def _advance(self) -> bool:
        """Finish the current bucket and make the next one current; False at the end of the update."""
        current = self._current
        if current is not None:
            if current.fused:
                self._hash_to(current, current.header.nbytes)
            self._current = None
            self._transport.release(current.token)
            self._engine._trace("unpack", current.header.index, self._unpack_started, time.perf_counter())
        arrived = await (await self._start()).get()
        if isinstance(arrived, BaseException):
            raise arrived
        header = arrived.header
        if header.abort:
            raise TransferError(
                f"{self._engine._peer_name()} aborted the update: {header.abort}", peer=self._engine._peer_name(),
            )
        if header.final:
            self._complete(header)
            return False
        self._current = arrived
        self._position = 0
        self._hashed = 0
        if arrived.fused:
            self._digest.begin_bucket(arrived.table, header.nbytes)
        self._unpack_started = time.perf_counter()
        return True

    def _hash_to(self, current: _Arrived, end: int) -> None:
        if end > self._hashed:
            self._digest.update_at(current.payload.data_ptr() + self._hashed, end - self._hashed)
            self._hashed = end

    def _copy_out(
        self, current: _Arrived, destinations: Mapping[str, torch.Tensor],
        fallback: Callable[[str, torch.Tensor], object] | None,
    ) -> int:
        """Copy the current bucket's remaining pieces to their destinations; the number of tensors completed.

        Runs once per tensor of the update: the common case (a host destination a raw copy can fill, a piece of at
        most ``PIECE_BYTES`` bytes) is kept to a few attribute reads and three appends to a batch, copied by one
        ``copy_batch`` call every ``PIECE_BYTES`` bytes and then hashed. Copies land in stream order (a batch is
        flushed before any other copy), should two names share a destination.
        """
        tensors = current.header.tensors
        if not current.fused:  # a device payload: every tensor goes through its view
            count = 0
            while self._position < len(tensors):
                meta = tensors[self._position]
                self._position += 1
                count += self._copy_viewed(current, meta, destinations.get(meta.name), fallback)
            return count
        base = current.payload.data_ptr()
        get = destinations.get
        if self._position == 0:
            plan = self._engine._bulk_plan(tensors)
            if plan is not None:
                completed = self._copy_bulk(plan, base, list(map(get, plan.names)))
                if completed is not None:
                    return completed
        hashed = self._hashed
        position = self._position
        batch: list[int] = []  # (destination address, bucket offset, nbytes) triples not copied yet
        count = copied = 0  # tensors completed; those of them completed here (``_copy_viewed`` counts its own)
        while position < len(tensors):
            meta = tensors[position]
            position += 1
            destination = get(meta.name)
            # The common destination, checked inline: the tensor's dtype and shape, contiguous, on the host, and
            # its memory holding the values it shows (not a lazily negated view, which even a real tensor can be:
            # a complex tensor's conjugate's ``imag``; nor a lazily conjugated complex one).
            if (destination is not None and destination.dtype is DTYPES.get(meta.dtype)
                    and destination.shape == meta.shape and destination.is_cpu and destination.is_contiguous()
                    and not destination.is_neg() and (meta.dtype not in COMPLEX_NAMES or not destination.is_conj())):
                address = destination.data_ptr()
            else:
                if batch:
                    copy_batch(batch, 0, base, stream=True)
                    batch.clear()
                self._position, self._hashed = position, hashed
                count += self._copy_viewed(current, meta, destination, fallback)
                hashed = self._hashed
                continue
            nbytes, at = meta.nbytes, meta.bucket_offset
            if nbytes <= PIECE_BYTES:  # most tensors: batched, the hash catches up every PIECE_BYTES bytes
                batch += (address + meta.offset, at, nbytes)
                if at + nbytes - hashed >= PIECE_BYTES:
                    copy_batch(batch, 0, base, stream=True)
                    batch.clear()
                    self._digest.update_at(base + hashed, at + nbytes - hashed)
                    hashed = at + nbytes
            else:
                if batch:
                    copy_batch(batch, 0, base, stream=True)
                    batch.clear()
                target, source = address + meta.offset, base + at
                for done in range(0, nbytes, PIECE_BYTES):  # streamed: the model's memory is not read back here
                    copy_stream(target + done, source + done, min(PIECE_BYTES, nbytes - done))
                    end = at + min(done + PIECE_BYTES, nbytes)
                    self._digest.update_at(base + hashed, end - hashed)
                    hashed = end
            if meta.offset + nbytes == meta.total_nbytes:
                copied += 1
        if batch:
            copy_batch(batch, 0, base, stream=True)
        self._position, self._hashed = position, hashed  # (after an error the stream is closed: no write-back)
        self._tensors += copied
        return count + copied

    def _copy_bulk(self, plan: _BulkPlan, base: int, found: list[torch.Tensor | None]) -> int | None:
        """A whole bucket of small pieces whose destinations all pass the inline check of ``_copy_out``: checked in
        one pass, then copied column-wise, one C call and one hash per ``PIECE_BYTES``. The tensors completed, or
        None when any destination does not pass (then nothing was copied and the per-tensor loop takes the bucket)."""
        if not all(destination is not None and destination.dtype is dtype and destination.shape == shape
                   and destination.is_cpu and destination.is_contiguous() and not destination.is_neg()
                   for destination, dtype, shape in zip(found, plan.dtypes, plan.shapes)):
            return None
        addresses = array.array("Q", [destination.data_ptr() for destination in found])  # type: ignore[union-attr]
        if plan.offsets is not None:  # the tail of a tensor split across buckets lands at its offset
            for index, offset in plan.offsets:
                addresses[index] += offset
        hashed = 0
        for start, stop, end in plan.chunks:
            copy_columns(addresses, plan.sources, plan.sizes, start, stop, base)
            self._digest.update_at(base + hashed, end - hashed)
            hashed = end
        self._position, self._hashed = len(found), hashed
        self._tensors += plan.completed
        return plan.completed

    def _copy_viewed(
        self, current: _Arrived, meta: TensorMeta, destination: torch.Tensor | None,
        fallback: Callable[[str, torch.Tensor], object] | None,
    ) -> int:
        """One piece through the view path: a fallback, or a destination a raw copy cannot fill (``copy_``)."""
        if destination is None and fallback is None:
            raise DestinationError(f"no destination for received tensor {meta.name!r} (and no fallback)",
                                   name=meta.name)
        if destination is not None:
            _check_destination(meta, destination)
        if current.fused and meta.bucket_offset - self._hashed >= PIECE_BYTES:
            self._hash_to(current, meta.bucket_offset)
        ready = self._tensor(meta, current.payload)
        if ready is None:
            return 0
        if destination is not None:
            with torch.no_grad():  # a model's parameters are valid destinations
                destination.copy_(ready[1])
        elif fallback is not None:
            fallback(*ready)
        return 1

    def _tensor(self, meta: TensorMeta, payload: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        dtype = dtype_from_name(meta.dtype)
        piece = payload[meta.bucket_offset: meta.bucket_offset + meta.nbytes]
        if meta.is_whole:
            self._tensors += 1
            return meta.name, _typed_view(piece, dtype, meta.shape)
        # A range of a tensor split across buckets: gather it in a scratch buffer reused across tensors.
        if self._scratch is None or self._scratch.numel() < meta.total_nbytes:
            self._scratch = torch.empty(meta.total_nbytes, dtype=torch.uint8, device=payload.device)
        self._scratch[meta.offset: meta.offset + meta.nbytes].copy_(piece)
        if meta.offset + meta.nbytes < meta.total_nbytes:
            return None
        self._tensors += 1
        return meta.name, _typed_view(self._scratch[: meta.total_nbytes], dtype, meta.shape)

    def _receive_loop(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[_Arrived | BaseException]
    ) -> None:
        engine = self._engine
        deadline = time.monotonic() + engine.timeout
        expected = 0
        fused: bool | None = None

        def deliver(item: _Arrived | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(self._deliver, queue, item)
            except RuntimeError:  # the consumer's loop is gone: nobody will read it
                if isinstance(item, _Arrived):
                    self._transport.release(item.token)

        try:
            while True:
                started = time.perf_counter()
                received: ReceivedBucket = self._transport.receive(deadline)
                header, table = codec.decode_bucket(received.header, epoch=engine.epoch,
                                                    capacity=self._transport.capacity, cache=engine._tables)
                if header.final or header.abort:
                    deliver(_Arrived(header, received.payload, received.token))
                    return
                if header.index != expected:
                    raise WireError(f"bucket {header.index} arrived where bucket {expected} was expected")
                expected += 1
                payload = received.payload[: header.nbytes]
                if engine._hook is not None and hasattr(engine._hook, "after_receive"):
                    engine._hook.after_receive(header.index, payload)
                if fused is None:  # one way for the whole update: the digest folds buckets in order
                    fused = self._digest.fusable and payload.device.type == "cpu"
                if not fused:
                    self._digest.update_bucket(table, payload)
                engine._trace("receive", header.index, started, time.perf_counter())
                self._receive_seconds += time.perf_counter() - started
                self._nbytes += sum(meta.nbytes for meta in header.tensors)
                self._buckets += 1
                deliver(_Arrived(header, payload, received.token, table, fused))
        except BaseException as exc:
            # This update is lost on this rank. Closing the transport now tells the peers (an upstream waiting for
            # our acknowledgement, a downstream waiting for our announcement) at once instead of at their deadline;
            # the next update joins a new epoch with new connections anyway.
            self._transport.close()
            deliver(exc)
        finally:
            self._release_hold()

    def _deliver(self, queue: asyncio.Queue[_Arrived | BaseException], item: _Arrived | BaseException) -> None:
        """On the consumer's loop. After the consumer left, buckets are acknowledged unread, so the sender (and
        every other receiver) can finish the update instead of waiting for this one until the deadline."""
        if self._abandoned:
            if isinstance(item, _Arrived):
                self._transport.release(item.token)
            return
        queue.put_nowait(item)

    def _release_hold(self) -> None:
        engine = self._engine
        with engine._claim:
            if self._holders == 0:  # closed before it took the engine over
                if engine._successor is self:
                    engine._successor = None
                return
            self._holders -= 1
            if self._holders == 0:
                if engine._draining is self:
                    engine._draining = None
                engine._busy.release()
            elif self._finished:  # the consumer left; the receive thread still drops the rest of the update
                engine._draining = self

    async def aclose(self) -> None:
        """The consumer stops early (its sink failed): the rest of the update is received and dropped."""
        self._close()

    def _complete(self, header: codec.BucketHeader) -> None:
        digest = self._digest.hexdigest()
        engine = self._engine
        try:
            if engine.verify_digest and header.digest != digest:
                raise DigestMismatchError(
                    f"rollout rank {engine.context.rank} received bytes whose digest {digest[:16]} differs from "
                    f"{engine._peer_name()}'s {header.digest[:16]}: the update was corrupted in transit",
                    receiver=engine.context.rank, expected=header.digest, actual=digest,
                )
            self.report = TransferReport(
                role="rollout", rank=engine.context.rank, version=header.version, nbytes=self._nbytes,
                tensors=self._tensors, buckets=self._buckets, seconds=time.perf_counter() - self._started,
                digest=digest, sender=header.sender,
                stages=(StageTiming(stage="receive", seconds=self._receive_seconds),),
            )
        finally:
            self._close()

    def _close(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._abandoned = True
        if self._current is not None:
            self._transport.release(self._current.token)
            self._current = None
        while self._queue is not None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Arrived):
                self._transport.release(item.token)
        self._release_hold()


def _check_destination(meta: TensorMeta, destination: torch.Tensor) -> None:
    if destination.dtype is not DTYPES.get(meta.dtype) or destination.shape != meta.shape:
        raise DestinationError(
            f"received tensor {meta.name!r} is {meta.dtype}{list(meta.shape)}, its destination "
            f"{str(destination.dtype).removeprefix('torch.')}{list(destination.shape)}", name=meta.name,
        )


def _typed_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if data.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=data.device)
    return data.view(dtype).reshape(shape)
