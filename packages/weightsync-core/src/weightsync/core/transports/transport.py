"""The ``Transport`` a backend implements: its buffers and connections, its topology and its device policy, built
once per worker by the engine; it hands the pipeline the two ends of the seam (:mod:`weightsync.core.transports.seam`)
once per membership epoch.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from weightsync.api.types import Topology, WorkerMetadata, WorldMetadata
from weightsync.core.transports.device import HOST_POLICY, DevicePolicy
from weightsync.core.transports.plan import Idle
from weightsync.core.transports.seam import BufferPlace, ReceiverTransport, SenderTransport
from weightsync.core.transports.settings import EngineSettings

__all__ = ["Transport"]


class Transport(abc.ABC):
    """A backend's part of an engine: its buffers and connections, its topology, and where its buffers live.

    The engine builds one per worker (``Transport(settings)``) and calls, in the lifecycle's order: ``prepare``
    (allocate or reuse buffers and endpoints; return the metadata peers need), ``build_topology`` (class-level, on
    the driver: each rank's plan, a struct of ``plans`` encoded with ``encode_plan``), ``connect_sender`` /
    ``connect_receiver`` once per membership epoch with the rank's plan decoded (its ``epoch`` is the epoch's token:
    every connection must present it), and ``release`` when the engine closes.
    """

    name: ClassVar[str]
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    """Device types of the tensors this transport's engine accepts."""
    option_names: ClassVar[frozenset[str]] = frozenset()
    """The backend's own engine options (read from ``settings.options``)."""
    default_slots: ClassVar[int] = 2
    """Buckets per side when ``slots`` is not given."""
    buffers: BufferPlace = "host"
    """Where this transport's ring lives; a device ring comes with a device policy."""
    plans: ClassVar[Any] = Idle
    """The plans (:mod:`weightsync.core.transports.plan` structs, or a union of them) its topology hands ranks."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings

    def prepare(self) -> WorkerMetadata:
        """Allocate/reuse what peers must know about and return it (merged into the worker's metadata)."""
        return {}

    @classmethod
    @abc.abstractmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        """Who sends to whom, from every worker's metadata (see the ``CheckpointEngine`` Protocol)."""

    @abc.abstractmethod
    def connect_sender(self, plan: Any) -> SenderTransport:
        """This epoch's sender end, for a rank whose plan (one of ``plans``) makes it a sender."""

    @abc.abstractmethod
    def connect_receiver(self, plan: Any) -> ReceiverTransport:
        """This epoch's receiver end, for a rank whose plan makes it a receiver."""

    def release(self) -> None:
        """Free what ``prepare`` allocated (segments, registrations, listening endpoints). Idempotent."""

    def policy(self) -> DevicePolicy:
        return HOST_POLICY

    def peer_name(self, sender: int) -> str:
        """How a receiver names the peer it receives from, in errors."""
        return f"actor rank {sender}"
