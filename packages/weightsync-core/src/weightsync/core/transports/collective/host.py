"""The collective transport on host buffers (gloo's): a broadcast from actor rank 0 to every rollout worker in a
private process group (:mod:`weightsync.core.transports.collective.group`).

Per bucket, two broadcasts: a control block of ``CONTROL_BYTES`` (slot, nbytes, header length, and the header
itself when it fits, as it does up to about a thousand tensors), then the payload; a longer header takes one more
broadcast between the two. Receivers keep their own ring of ``slots`` buffers, so receiving bucket k+1 overlaps the
consumer unpacking bucket k.
"""

from __future__ import annotations

import struct
from typing import Any, ClassVar

import torch

from weightsync.api.errors import TransferError
from weightsync.core.transports.collective.group import (
    MAX_HEADER_BYTES,
    Group,
    GroupReceive,
    GroupSend,
    GroupTransport,
    gloo_group,
)
from weightsync.core.transports.seam import NO_SLOT, ReceivedBucket
from weightsync.core.transports.waiting import FreeSlots
from weightsync.core.wire.tensors import memoryview_of

__all__ = ["CONTROL_BYTES", "CollectiveTransport"]


CONTROL_BYTES = 64 * 1024
_PREFIX = struct.Struct("<qqq")  # slot, nbytes, header length
_INLINE = CONTROL_BYTES - _PREFIX.size


class _Sender:
    def __init__(self, group: Group, buffers: list[torch.Tensor], capacity: int) -> None:
        self.slots = len(buffers)
        self.capacity = capacity
        self._group = group
        self._buffers = buffers
        self._control = bytearray(CONTROL_BYTES)
        self._control_tensor = torch.frombuffer(self._control, dtype=torch.uint8)

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def wait_slot(self, slot: int, deadline: float) -> None:
        """A broadcast returns once its buffer may be reused, so a published slot is free by construction."""

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        _PREFIX.pack_into(self._control, 0, slot, nbytes, len(header))
        inline = header[:_INLINE]
        self._control[_PREFIX.size:_PREFIX.size + len(inline)] = inline
        self._group.broadcast(self._control_tensor)
        if len(header) > _INLINE:
            self._group.broadcast(torch.frombuffer(bytearray(header[_INLINE:]), dtype=torch.uint8))
        if nbytes:
            self._group.broadcast(self._buffers[slot][:nbytes])

    def close(self) -> None:
        self._group.close()


class _Receiver:
    def __init__(self, group: Group, buffers: list[torch.Tensor], capacity: int) -> None:
        self.capacity = capacity
        self._group = group
        self._buffers = buffers
        self._free = FreeSlots(len(buffers))
        self._control = bytearray(CONTROL_BYTES)
        self._control_tensor = torch.frombuffer(self._control, dtype=torch.uint8)

    def receive(self, deadline: float) -> ReceivedBucket:
        slot = self._free.take(deadline)
        try:
            self._group.broadcast(self._control_tensor)
            sender_slot, nbytes, header_len = _PREFIX.unpack_from(self._control, 0)
            if not 0 <= nbytes <= self.capacity or not 0 <= header_len <= MAX_HEADER_BYTES:
                raise TransferError(f"{self._group.peer} announced {nbytes} bytes / header {header_len}",
                                    peer=self._group.peer)
            header = bytes(self._control[_PREFIX.size:_PREFIX.size + min(header_len, _INLINE)])
            if header_len > _INLINE:
                rest = torch.empty(header_len - _INLINE, dtype=torch.uint8)
                self._group.broadcast(rest)
                header += _to_bytes(rest)
            if sender_slot == NO_SLOT or nbytes == 0:
                self.release(slot + 1)
                return ReceivedBucket(header=header, payload=self._buffers[slot][:0], token=0)
            payload = self._buffers[slot][:nbytes]
            self._group.broadcast(payload)
        except BaseException:
            self.release(slot + 1)
            raise
        return ReceivedBucket(header=header, payload=payload, token=slot + 1)

    def release(self, token: int) -> None:
        if token > 0:
            self._free.give(token - 1)

    def close(self) -> None:
        self._group.close()


def _to_bytes(tensor: torch.Tensor) -> bytes:
    host = tensor.cpu().contiguous()  # held while its memory is read: the memoryview does not keep it alive
    return bytes(memoryview_of(host))


class CollectiveTransport(GroupTransport):
    """Broadcast over a private gloo group, on host buffers."""

    name: ClassVar[str] = "gloo"

    def new_group(self, store: Any, rank: int, size: int) -> Any:
        return gloo_group(store, rank, size, timeout=self.settings.timeout, host_ip=self.settings.context.host_ip)

    def ring(self) -> list[torch.Tensor]:
        if self._buffers is None:
            # Allocated once per engine and touched now, so no update pays for first-touch page faults.
            self._buffers = [
                torch.zeros(self.settings.bucket_bytes, dtype=torch.uint8, device=self.device_type)
                for _ in range(self.settings.slots)
            ]
        return self._buffers

    def connect_sender(self, plan: GroupSend) -> _Sender:
        return _Sender(self.join(plan), self.ring(), self.settings.bucket_bytes)

    def connect_receiver(self, plan: GroupReceive) -> _Receiver:
        return _Receiver(self.join(plan), self.ring(), self.settings.bucket_bytes)
