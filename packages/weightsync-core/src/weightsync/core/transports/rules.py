"""The rules between the pipeline and a transport (stated in :mod:`weightsync.core.transports.transport`), checked.

An engine built with ``check_transport=True`` (tests: the conformance kit turns it on for every bucket engine)
wraps its transports in :class:`CheckedSender` / :class:`CheckedReceiver`, which raise :class:`TransportRuleError`
naming the rule as soon as either side breaks one:

* the transport's: a marker (``NO_SLOT``) carries token 0, a bucket a positive token that none of the buckets still
  held carries, and a payload no longer than ``capacity``; a host payload keeps its bytes until its token is
  released (hashed when it arrives and again at its release, ``hold`` seconds later: a transport that lets its
  sender reuse the buffer early is caught while the consumer still holds it);
* the pipeline's: it releases each bucket's token once, in the order the buckets arrived (transports that
  acknowledge by sequence count on it), never a token it was not given; and it packs into a slot only after
  ``wait_slot`` for it returned since the slot was last published.
"""

from __future__ import annotations

import collections
import threading
import time

import torch
import xxhash

from weightsync.core.transports.seam import (
    NO_SLOT,
    OrdersPackedSlots,
    ReceivedBucket,
    ReceiverTransport,
    SenderTransport,
)
from weightsync.core.wire import codec
from weightsync.core.wire.tensors import memoryview_of

__all__ = ["TransportRuleError", "CheckedSender", "CheckedReceiver", "checked_sender"]


class TransportRuleError(AssertionError):
    """A transport or the pipeline broke one of the rules between them (the message names it)."""


class CheckedSender:
    """A :class:`SenderTransport` that checks the pipeline's side of the slot rules, then calls the real one."""

    def __init__(self, inner: SenderTransport) -> None:
        self.inner = inner
        self.slots = inner.slots
        self.capacity = inner.capacity
        self._waited = [True] * inner.slots
        """Per slot: ``wait_slot`` returned since the slot was last published (every slot starts free)."""

    def buffer(self, slot: int) -> torch.Tensor:
        self._in_range(slot)
        return self.inner.buffer(slot)

    def wait_slot(self, slot: int, deadline: float) -> None:
        self._in_range(slot)
        self.inner.wait_slot(slot, deadline)
        self._waited[slot] = True

    def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
        if slot != NO_SLOT:
            self._in_range(slot)
            if not self._waited[slot]:
                raise TransportRuleError(f"the pipeline published slot {slot} again without wait_slot({slot}) since "
                                         "it last published it: a receiver may still be reading it")
            if not 0 <= nbytes <= self.capacity:
                raise TransportRuleError(f"the pipeline published {nbytes} bytes from a slot of {self.capacity}")
            self._waited[slot] = False
        self.inner.publish(slot, nbytes, header, deadline)

    def close(self) -> None:
        self.inner.close()

    def _in_range(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise TransportRuleError(f"slot {slot} outside the transport's {self.slots}")


class _CheckedOrderedSender(CheckedSender):
    """A :class:`CheckedSender` of a transport that orders its moves after the packing's event."""

    def __init__(self, inner: SenderTransport, ordered: OrdersPackedSlots) -> None:
        super().__init__(inner)
        self._ordered = ordered

    def mark_packed(self, slot: int) -> None:
        self._ordered.mark_packed(slot)


def checked_sender(inner: SenderTransport) -> CheckedSender:
    """``inner`` checked, keeping its optional capabilities (:class:`OrdersPackedSlots`)."""
    return _CheckedOrderedSender(inner, inner) if isinstance(inner, OrdersPackedSlots) else CheckedSender(inner)


class CheckedReceiver:
    """A :class:`ReceiverTransport` that checks the transport's tokens and payloads, and the pipeline's releases.

    ``stable``: also check that host payloads keep their bytes until released (off where a test hook rewrites
    payloads on purpose); ``hold``: seconds each such release waits before looking, giving a transport that broke
    the rule the time to show it."""

    def __init__(self, inner: ReceiverTransport, *, stable: bool = True, hold: float = 0.002) -> None:
        self.inner = inner
        self.capacity = inner.capacity
        self._stable = stable
        self._hold = hold
        self._held: collections.OrderedDict[int, tuple[torch.Tensor, bytes | None]] = collections.OrderedDict()
        """Buckets received and not yet released, in arrival order: token → (payload, its hash at arrival)."""
        self._lock = threading.Lock()

    def receive(self, deadline: float) -> ReceivedBucket:
        received = self.inner.receive(deadline)
        marker = codec.decode_bucket(received.header, epoch=None, capacity=self.capacity)[0].slot == NO_SLOT
        payload, token = received.payload, received.token
        if payload.numel() > self.capacity:
            raise TransportRuleError(f"the transport gave a payload of {payload.numel()} bytes, capacity "
                                     f"{self.capacity}")
        if marker:
            if token != 0:
                raise TransportRuleError(f"the transport gave a marker token {token}, not 0")
            return received
        with self._lock:
            if token <= 0 or token in self._held:
                raise TransportRuleError(f"the transport gave a bucket token {token}: not positive, or one a "
                                         f"bucket still held carries ({list(self._held)})")
            self._held[token] = (payload, _hash(payload) if self._stable else None)
        return received

    def release(self, token: int) -> None:
        if token <= 0:
            self.inner.release(token)
            return
        with self._lock:
            if token not in self._held:
                raise TransportRuleError(f"the pipeline released token {token}, which it does not hold (released "
                                         "twice, or never received)")
            oldest = next(iter(self._held))
            if token != oldest:
                raise TransportRuleError(f"the pipeline released token {token} before {oldest}: releases go in the "
                                         "order the buckets arrived")
            payload, arrived = self._held[token]
        if arrived is not None:
            time.sleep(self._hold)  # still held meanwhile: a transport that handed its buffer on shows it now
            if _hash(payload) != arrived:
                raise TransportRuleError(f"the payload of token {token} changed before its release: the transport "
                                         "let its buffer be reused while the consumer held it")
        with self._lock:
            del self._held[token]
        self.inner.release(token)

    def close(self) -> None:
        self.inner.close()


def _hash(payload: torch.Tensor) -> bytes | None:
    """The payload's XXH3, or None for a device payload (ordered by events, not checked here)."""
    if payload.device.type != "cpu":
        return None
    return xxhash.xxh3_128_digest(memoryview_of(payload)) if payload.numel() else b""
