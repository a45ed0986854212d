"""Typed errors raised by weightsync.

Every error a caller can act on has its own class, and every class derives from :class:`WeightsyncError`, so
``except WeightsyncError`` catches all of ours and nothing else. Where a builtin category fits, the class also
derives from it (a bad argument is a ``ValueError``, a timeout is a ``TimeoutError``), so code written against the
standard library keeps working.

The messages are meant to be read by the person who has to fix the problem: a bad argument names the argument and
what was expected, a timeout names the step and the workers that did not answer, a transfer error names the peer.

All errors survive pickling with their fields intact, because Ray carries a remote worker's exception back to the
driver by pickling it (that is Ray's own control plane, not one of our sockets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "WeightsyncError",
    "ConfigError",
    "UnknownBackendError",
    "BackendUnavailableError",
    "TopologyError",
    "WeightStreamError",
    "DuplicateTensorError",
    "UnsupportedDtypeError",
    "UnsupportedDeviceError",
    "DestinationError",
    "LifecycleError",
    "ConcurrentUpdateError",
    "WireError",
    "EpochMismatchError",
    "TransferError",
    "SharedMemoryFullError",
    "DigestMismatchError",
    "PartMismatchError",
    "LoadVerificationError",
    "ReplicaTornError",
    "StepTimeoutError",
    "HostUnreachableError",
    "WorkerError",
    "WorkerDiedError",
    "RenamedKeywordError",
]


class WeightsyncError(Exception):
    """Base class of every error weightsync raises on purpose.

    ``details`` holds the error's facts as keywords (each also an attribute of that name). One fact any error may
    carry: ``untouched`` — a worker's update failed before any byte reached its model, which still holds what it
    held (the manager then counts its replica untouched, not torn).
    """

    untouched: bool = False

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details)
        for key, value in details.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through __init__ so subclasses with keyword fields round-trip through pickle.
        return (_rebuild, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[WeightsyncError], message: str, details: dict[str, Any]) -> WeightsyncError:
    return cls(message, **details)


class ConfigError(WeightsyncError, ValueError):
    """A configuration value is out of range or of the wrong kind (raised where it is given)."""


class UnknownBackendError(WeightsyncError, LookupError):
    """No installed distribution provides the requested backend. ``install`` names what to install."""

    backend: str
    install: str


class BackendUnavailableError(WeightsyncError, RuntimeError):
    """The backend is installed but cannot run here (no device, a library fails to load); ``reason`` says why."""

    backend: str
    reason: str


class TopologyError(WeightsyncError, ValueError):
    """``build_topology`` produced, or was given, something inconsistent with the world sizes or the peers."""


class WeightStreamError(WeightsyncError, ValueError):
    """The ``(name, tensor)`` stream handed to ``send_weights`` is malformed (not a pair, not a tensor, bad name...)."""


class DuplicateTensorError(WeightStreamError):
    """The same tensor name appeared twice in one update."""

    name: str


class UnsupportedDtypeError(WeightStreamError):
    """A tensor's dtype cannot be moved by this backend (or is not a dtype weightsync knows)."""


class UnsupportedDeviceError(WeightStreamError):
    """A tensor lives on a device the backend does not serve (e.g. a CUDA tensor given to the shm backend)."""


class DestinationError(WeightsyncError, ValueError):
    """A received tensor cannot be copied into the destinations given for it (``ReceivedWeights.copy_into``): no
    destination of its name and no fallback, or a destination whose dtype or shape differs. ``name`` names it."""

    name: str


class LifecycleError(WeightsyncError, RuntimeError):
    """A lifecycle method was called out of order (send before ``init_process_group``, use after ``close``...)."""


class ConcurrentUpdateError(LifecycleError):
    """A second update was started on a manager or engine while one is still running."""


class WireError(WeightsyncError, ValueError):
    """Bytes received from a peer do not decode to a valid, supported message; they were rejected, not used."""


class EpochMismatchError(WireError):
    """A peer presented a token from another membership epoch (a stale or foreign connection)."""


class TransferError(WeightsyncError, RuntimeError):
    """Moving a bucket to or from a peer failed; ``peer`` names it, and ``closed`` is true when the peer's end
    of the connection is gone (its process exited or was killed) rather than slow or broken mid-stream."""

    peer: str
    closed: bool = False
    rail: int | None = None
    """A stripe read over the network failed on this rail (its sender's and its reader's hosts: ``hosts``)."""
    hosts: Sequence[str] = ()


class SharedMemoryFullError(WeightsyncError, MemoryError):
    """A shared-memory segment (a ring, a host's ring, a staging area) did not fit in ``path`` (``/dev/shm``): its
    pages are reserved when it is created or grown, so a full tmpfs is this error in the process that tried, not a
    ``SIGBUS`` at the first write. ``free`` and ``size``: the file system's free and total bytes when it failed;
    ``needed``: what the segment asked for. The fix: a larger ``/dev/shm`` (a container's ``--shm-size``) or
    smaller ``bucket_bytes`` / ``slots``."""

    path: str
    free: int
    size: int
    needed: int


class DigestMismatchError(WeightsyncError, RuntimeError):
    """What a receiver holds after an update is not what the sender sent (the end-to-end digests differ)."""


class PartMismatchError(DigestMismatchError):
    """A worker that declared its part (``weightsync.api.parts``) received less than its part, or other bytes:
    ``receiver`` names the rollout rank, ``tensor`` the first checkpoint tensor whose regions differ from what the
    sender sent that part (empty when the worker received fewer or more of its part's tensors than were sent)."""

    receiver: int
    tensor: str


class LoadVerificationError(WeightsyncError, RuntimeError):
    """What an inference engine holds after an update is not what it was sent, though the transfer itself verified:
    its own checksums disagree with other replicas', or its loader left parts of the model without weights.
    ``replica`` names the replica and ``parameter`` the first parameter (or module) found wrong."""

    replica: str
    parameter: str


class ReplicaTornError(WeightsyncError, RuntimeError):
    """A request was aborted, or refused, because its replica's weights are torn: an update reached it part-way and
    it stays paused until the next update repairs it. ``replica`` names it; ``reason`` is the failed update's
    error."""

    replica: str
    reason: str


class StepTimeoutError(WeightsyncError, TimeoutError):
    """A lifecycle step did not finish in time; ``step`` names it and ``workers`` lists those still pending."""

    step: str
    workers: Sequence[str]


class HostUnreachableError(StepTimeoutError):
    """A step timed out and some of its pending workers did not answer a probe either: their host, or its link, is
    down. ``hosts`` names those hosts (name and address, as the workers reported them at setup), ``unreachable``
    the workers on them; ``workers`` still lists every worker the step was waiting for (the others were waiting
    for the unreachable ones)."""

    hosts: Sequence[str]
    unreachable: Sequence[str]


class WorkerError(WeightsyncError, RuntimeError):
    """A worker failed or died during a step; ``worker`` names it and ``step`` the step it was in."""

    worker: str
    step: str


class WorkerDiedError(WorkerError):
    """A worker's process is gone (Ray declared its actor dead; a vLLM replica's engine is dead), not merely
    failing: ``worker`` names it. Found before or during an update, its replica is evicted
    (``SyncConfig.max_evicted``)."""


class RenamedKeywordError(WeightsyncError, TypeError):
    """A caller passed ``trainer=`` or ``trainer_world_size=``: the keywords are ``actor_wg`` and
    ``actor_wg_world_size``. ``weightsync migrate`` rewrites such calls."""


def reject_renamed_keywords(where: str, kwargs: dict[str, Any]) -> None:
    """Raise :class:`RenamedKeywordError` if ``kwargs`` holds one of the keywords renamed to ``actor_wg*``.

    APIs that accept ``**options`` call this so that an old-style call fails with a message that says what to do,
    instead of being swallowed as an unknown option or failing later with a generic ``TypeError``.
    """
    renamed = {"trainer": "actor_wg", "trainer_world_size": "actor_wg_world_size", "trainer_kwargs": "actor_wg_kwargs"}
    for old, new in renamed.items():
        if old in kwargs:
            raise RenamedKeywordError(
                f"{where}() got the keyword {old}=, which was renamed to {new}=; "
                f"run `weightsync migrate PATH` to rewrite such calls"
            )
