"""Device streams and events, written once for every accelerator, and the policy that orders the pipeline on them.

:class:`AcceleratorOps` is the handful of stream/event operations the device paths use, over torch's generic
accelerator API: CUDA, Ascend and any other torch accelerator alike. :class:`AcceleratorPolicy` is the :class:`~weightsync.core.transports.transport.
DevicePolicy` of a transport with device buffers:

* **Two streams and events, never a device-wide sync.** Packing copies run on a *copy stream*; the transport moves
  buckets on its own stream, ordered by per-slot events, so packing bucket k+1 overlaps moving bucket k. Host
  threads wait only on single events, by polling with a deadline (:func:`wait_event`).
* **Producer ordering.** The weights stream is produced on the caller's current stream (an FSDP all-gather, say);
  the copy stream waits for that stream before reading, and every source tensor is ``record_stream``'d on the copy
  stream so the caching allocator cannot hand its memory to the producer while a copy still reads it.
* **The end-to-end digest.** The pipeline hashes each bucket's bytes on the host (XXH3). A device bucket is staged
  into one pinned host buffer on a stream of its own, then hashed: one device-to-host copy per bucket on each side,
  overlapping the next transfer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.core.transports.seam import OrdersPackedSlots, SenderTransport
from weightsync.core.transports.waiting import poll_until
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.layout import PlannedBucket

__all__ = [
    "HOST_POLICY", "AcceleratorOps", "AcceleratorPolicy", "DevicePolicy", "accepted_devices", "process_accelerator",
    "wait_event",
]


class DevicePolicy:
    """How the pipeline orders its copies around a transport's buffers. This one, for host buffers, adds nothing.

    A device transport returns its own (see :mod:`weightsync.core.transports.device`): packing then runs on a copy stream that
    waits for the stream that produced the weights, and a bucket's digest stages device bytes to the host.
    """

    def begin_send(self) -> None:
        """On the caller's thread as ``send_weights`` starts (a device policy notes the producer's stream)."""

    def end_send(self) -> None:
        """As ``send_weights`` ends, however it ends."""

    @contextlib.contextmanager
    def packing(self, transport: SenderTransport, slot: int, bucket: PlannedBucket) -> Iterator[None]:
        """Around the packing of ``bucket`` into ``slot`` (on the pack thread)."""
        yield

    def new_digest(self) -> UpdateDigest:
        """The digest one update's buckets are folded into, on either side."""
        return UpdateDigest()

    def accelerator(self) -> tuple[AcceleratorOps, Any] | None:
        """For device buffers: the accelerator's operations and the stream packing copies run on (the pipeline
        uploads host pieces into a device bucket on it); None for host buffers."""
        return None


HOST_POLICY = DevicePolicy()


HOST_POLICY = DevicePolicy()
"""The policy of a transport whose buffers are on the host: nothing to order."""


class AcceleratorOps:
    """The handful of stream/event operations the device paths use, over one accelerator, kept this small so that
    every synchronisation weightsync does is visible here. Written once against torch's generic API
    (``torch.Stream``, ``torch.Event``, ``torch.accelerator``): CUDA, Ascend (torch_npu) and any other PrivateUse1
    device (the emulated one of the tests) share it; only the collective library is backend-specific."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cpu":
            raise ValueError("AcceleratorOps needs an accelerator device, not the host")
        self.device = device if device.index is not None else torch.device(
            device.type, torch.accelerator.current_device_index())
        self.pinned = True

    def new_stream(self) -> Any:
        return torch.Stream(device=self.device)

    def new_event(self) -> Any:
        return torch.Event(device=self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        # ``with stream:`` makes it the current stream of its device (and that device the current one).
        context: contextlib.AbstractContextManager[Any] = stream
        return context

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device)

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type == self.device.type:
            tensor.record_stream(stream)


def process_accelerator() -> torch.device | None:
    """The accelerator this process computes on (its current device), or None on a host-only process.

    Whatever torch reports as the current accelerator: CUDA, an Ascend NPU, or any PrivateUse1 device (the emulated
    one of the tests). Cheap: it does not create a device context.
    """
    current = torch.accelerator.current_accelerator()
    if current is None:
        return None
    return torch.device(current.type, torch.accelerator.current_device_index())


def accepted_devices() -> frozenset[str]:
    """The device types every engine accepts tensors on in this process: the host and its accelerator."""
    current = torch.accelerator.current_accelerator()
    return frozenset({"cpu"} if current is None else {"cpu", current.type})


def wait_event(ops: AcceleratorOps, event: Any, deadline: float, *, peer: str, what: str) -> None:
    """Block the calling thread until ``event`` completes, or raise ``TransferError`` at ``deadline``.

    Polls ``query()`` (50 µs growing to 2 ms) instead of ``event.synchronize()``: a blocking synchronize cannot be
    given a deadline, and a peer that never joins the collective would freeze the thread.
    """
    poll_until(lambda: ops.query(event), deadline=deadline, peer=peer, what=f"waiting for {what} with",
               most=2e-3)


class _StagedDigest(UpdateDigest):
    """The pipeline's digest, fed device buckets: each payload is staged to host bytes first (whole buckets only)."""

    fusable = False

    def __init__(self, inner: UpdateDigest, stage: Any) -> None:
        # No super().__init__(): every call is delegated to ``inner``, which owns the hash state.
        self._inner = inner
        self._stage = stage

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self._inner.update_bucket(table, self._stage(payload))

    def hexdigest(self) -> str:
        return self._inner.hexdigest()

    def host(self) -> UpdateDigest:
        return self._inner


class AcceleratorPolicy(DevicePolicy):
    """Orders the pipeline's copies on ``ops``'s streams (see the module docstring)."""

    def __init__(self, ops: AcceleratorOps, *, bucket_bytes: int, timeout: float) -> None:
        self.ops = ops
        self.bucket_bytes = bucket_bytes
        self.timeout = timeout
        self.copy_stream = ops.new_stream()
        self.stage_stream = ops.new_stream()
        self.staging: torch.Tensor | None = None
        self._producer_stream: Any = None

    def begin_send(self) -> None:
        # The stream's tensors were produced on the caller's current stream; packing waits for it (device-side).
        self._producer_stream = self.ops.current_stream()

    def end_send(self) -> None:
        self._producer_stream = None

    def accelerator(self) -> tuple[AcceleratorOps, Any]:
        return self.ops, self.copy_stream

    @contextlib.contextmanager
    def packing(self, transport: SenderTransport, slot: int, bucket: PlannedBucket) -> Iterator[None]:
        ops = self.ops
        with ops.use(self.copy_stream):
            if self._producer_stream is not None:
                ops.stream_wait_stream(self.copy_stream, self._producer_stream)
            for _, source, _ in bucket.items:
                ops.keep_alive(source, self.copy_stream)
            yield
            if isinstance(transport, OrdersPackedSlots):  # it orders its move of ``slot`` after this event
                transport.mark_packed(slot)
                return
            # A transport that knows no streams (a ring another process reads one-sidedly) publishes the slot as
            # soon as packing returns: the bytes must be there by then.
            packed = ops.new_event()
            ops.record(packed, self.copy_stream)
        wait_event(ops, packed, time.monotonic() + self.timeout, peer="local device", what="packing a bucket")

    def new_digest(self) -> UpdateDigest:
        """Device buckets are staged to host bytes before hashing."""
        return _StagedDigest(UpdateDigest(), self.to_host)

    def to_host(self, payload: torch.Tensor) -> torch.Tensor:
        """``payload``'s bytes on the host, for the digest: a pinned staging buffer reused for every bucket."""
        if payload.device.type == "cpu":
            return payload
        ops = self.ops
        if self.staging is None:
            self.staging = torch.empty(self.bucket_bytes, dtype=torch.uint8, pin_memory=ops.pinned)
        host = self.staging[: payload.numel()]
        current = ops.current_stream()
        with ops.use(self.stage_stream):
            # Called on the thread that produced the payload, inside its stream (the copy stream when packing; the
            # receive thread's stream after the bucket's arrival was awaited): wait for that stream only, so that
            # staging bucket k never waits for the transfer of bucket k-1.
            ops.stream_wait_stream(self.stage_stream, current)
            ops.keep_alive(payload, self.stage_stream)
            host.copy_(payload, non_blocking=True)
            done = ops.new_event()
            ops.record(done, self.stage_stream)
        wait_event(ops, done, time.monotonic() + self.timeout, peer="local device", what="staging a bucket")
        return host
