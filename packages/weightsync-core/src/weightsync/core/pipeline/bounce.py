"""The host bounce: a sender's tensors into a transport whose buffers live on another device.

Every engine takes tensors on the host or on the process's accelerator, whatever its transport's buffers are. For a
transport with host buffers (shm, gloo, nixl and mooncake with host rings), the pieces of a bucket that live on the
accelerator are bounced through pinned host memory by :class:`HostBounce`:

* **One pinned host bucket, asynchronous copies, one event.** The device pieces are copied to a page-locked host
  buffer, at their offsets in the bucket, with non-blocking copies queued on a *copy stream* of the bounce's own.
  That stream first waits for the stream that produced the weights (the caller's current stream when the bucket was
  planned: an FSDP all-gather, say), device-side. The packing thread then waits for one event recorded after the
  copies — polled against the update's deadline, never a device-wide synchronize.
* **Overlap.** The bounce runs on the pipeline's packing thread, so the device-to-host copies of bucket k+1 run while
  the transfer thread publishes bucket k.
* **The digest reads host bytes only.** The bounced bucket is packed like any host bucket: its pieces' sources are
  replaced by the bounced bytes, so the pipeline's copy into the transport's buffer hashes them as it goes
  (:func:`weightsync.core.wire.layout.pack_hashing`); no device memory is ever read from Python or by the hash. The cost is
  one host copy of the device pieces, which the hash reads anyway (docs/performance.md explains the choice).
* **Lifetime.** The bucket holds a reference to every source until the bounce's event has completed on the host, so
  the caching allocator cannot reuse a source's memory while a copy still reads it (no ``record_stream`` needed).

For a transport with device buffers (nccl, hccl, device rings), :class:`Upload` does the reverse for host pieces:
they are copied (and, when the whole bucket comes from the host, hashed as they go, so the device bucket is never
read back for the digest) into one of two pinned host buckets, which is copied to the device bucket with one
non-blocking copy on the policy's copy stream; the bucket's device pieces are copied after it on the same stream. A
pinned bucket is refilled only once the event recorded after its copy has completed.

The receiving side needs no bounce of its own: a host bucket's pieces are copied into device destinations with
``Tensor.copy_`` (:mod:`weightsync.core.pipeline.unpack`), which returns once the bytes have left the bucket, and the bucket
is released only after that.
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.api.errors import UnsupportedDeviceError
from weightsync.core.transports.device import AcceleratorOps, wait_event
from weightsync.core.wire.layout import PIECE_BYTES, PackItem, PlannedBucket, piece_bytes

__all__ = ["HostBounce", "Upload"]


class HostBounce:
    """Bounces the device pieces of a sender's buckets through pinned host memory (see the module docstring)."""

    def __init__(self, device: torch.device, *, bucket_bytes: int) -> None:
        self.ops = AcceleratorOps(device)
        self.device = self.ops.device
        self.copy_stream = self.ops.new_stream()
        # Allocated once per engine and touched now, so that no update pays for first-touch page faults.
        self.host = torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=True)
        self.host.fill_(0)
        self.producer: Any = None

    def begin(self) -> None:
        """On the planning thread as an update's first device bucket is planned: note the producer's stream."""
        self.producer = self.ops.current_stream()

    def bounce(self, bucket: PlannedBucket, deadline: float) -> PlannedBucket:
        """``bucket`` with its device pieces copied to the pinned host bucket, ready to pack from host memory."""
        ops, host = self.ops, self.host
        bounced = PlannedBucket(nbytes=bucket.nbytes, payload_bytes=bucket.payload_bytes, completed=bucket.completed)
        with ops.use(self.copy_stream):
            if self.producer is not None:
                ops.stream_wait_stream(self.copy_stream, self.producer)
            for item in bucket.items:
                meta, source, start = item
                piece: PackItem = item
                if not source.is_cpu:
                    if source.device != self.device:
                        raise UnsupportedDeviceError(
                            f"tensor {meta.name!r} is on {source.device}, but this process's accelerator is "
                            f"{self.device}: weightsync moves tensors of the current device and the host")
                    at = meta.bucket_offset
                    if meta.nbytes:
                        host[at:at + meta.nbytes].copy_(piece_bytes(item), non_blocking=True)
                    piece = (meta, host, at)
                bounced.items.append(piece)
                if meta.nbytes <= PIECE_BYTES:
                    bounced.copies += (meta.bucket_offset, piece[1].data_ptr() + piece[2], meta.nbytes)
                else:
                    bounced.large.append(piece)
            copied = ops.new_event()
            ops.record(copied, self.copy_stream)
        wait_event(ops, copied, deadline, peer="local device", what="bouncing a bucket to the host")
        return bounced


class Upload:
    """Two pinned host buckets that host pieces are packed into before one copy to a device bucket."""

    def __init__(self, ops: AcceleratorOps, *, bucket_bytes: int) -> None:
        self.ops = ops
        self.buckets = [torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        for host in self.buckets:
            host.fill_(0)  # touched now, not during an update
        self.copied: list[Any] = [None, None]
        self._next = 0

    def take(self, deadline: float) -> torch.Tensor:
        """The next pinned bucket, once its previous copy to the device has run."""
        copied = self.copied[self._next]
        if copied is not None:
            wait_event(self.ops, copied, deadline, peer="local device", what="an upload to the device")
        return self.buckets[self._next]

    def send(self, buffer: torch.Tensor, bucket: PlannedBucket, stream: Any) -> None:
        """Queue, on ``stream``: the taken bucket's bytes into ``buffer``, then ``bucket``'s device pieces."""
        host = self.buckets[self._next]
        buffer[:bucket.nbytes].copy_(host[:bucket.nbytes], non_blocking=True)
        for item in bucket.items:
            meta, source, _ = item
            if meta.nbytes and not source.is_cpu:
                buffer[meta.bucket_offset:meta.bucket_offset + meta.nbytes].copy_(piece_bytes(item))
        copied = self.ops.new_event()
        self.ops.record(copied, stream)
        self.copied[self._next] = copied
        self._next ^= 1
