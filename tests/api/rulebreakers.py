"""Engines whose transports break the rules between pipeline and transport, for the kit's negative controls.

Each wraps a real receiver and frees what it received as soon as it arrives instead of at its release: ``early-free``
gloo gives its slot back (the next bucket in that slot arrives under the token of one still held: rule 2), and
``early-ack`` shm acknowledges at once (the sender overwrites the slot while the consumer still reads it: rule 3).
"""

from __future__ import annotations

from typing import ClassVar

from weightsync.api.registry import BackendSpec, module_importable
from weightsync.core.backend import ReceivedBucket, ReceiverTransport, engine_class
from weightsync.core.transports.collective.group import GroupReceive
from weightsync.gloo.collective import GlooTransport
from weightsync.shm.engine import ShmReceive, ShmTransport


class _FreedOnArrival:
    """``inner``'s buckets, each released the moment it arrives; the pipeline's own releases do nothing."""

    def __init__(self, inner: ReceiverTransport) -> None:
        self.inner = inner
        self.capacity = inner.capacity

    def receive(self, deadline: float) -> ReceivedBucket:
        received = self.inner.receive(deadline)
        self.inner.release(received.token)
        return received

    def release(self, token: int) -> None:
        pass

    def close(self) -> None:
        self.inner.close()


class EarlyFreeGlooTransport(GlooTransport):
    name: ClassVar[str] = "test-early-free-gloo"

    def connect_receiver(self, plan: GroupReceive) -> _FreedOnArrival:  # type: ignore[override]
        return _FreedOnArrival(super().connect_receiver(plan))


class EarlyAckShmTransport(ShmTransport):
    name: ClassVar[str] = "test-early-ack-shm"

    def connect_receiver(self, plan: ShmReceive) -> _FreedOnArrival:  # type: ignore[override]
        return _FreedOnArrival(super().connect_receiver(plan))


EarlyFreeGlooEngine = engine_class(EarlyFreeGlooTransport)
EarlyAckShmEngine = engine_class(EarlyAckShmTransport)

SPECS = {
    engine.name: BackendSpec(name=engine.name, engine=f"{__name__}:{variable}", distribution="tests",
                             devices=frozenset({"cpu"}), cross_node=False, probe=lambda: module_importable("torch"))
    for variable, engine in (("EarlyFreeGlooEngine", EarlyFreeGlooEngine), ("EarlyAckShmEngine", EarlyAckShmEngine))
}
EARLY_FREE_GLOO = SPECS["test-early-free-gloo"]
EARLY_ACK_SHM = SPECS["test-early-ack-shm"]
