"""``SyncConfig``: the one configuration type shared by the manager, the CLI, the adapters and the benchmark."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.api.errors import ConfigError
from weightsync.api.types import JsonValue, json_safe

__all__ = ["StepTimeouts", "SyncConfig", "BUCKET_ALIGNMENT", "MiB"]

MiB = 1 << 20
BUCKET_ALIGNMENT = 256
"""Byte alignment of every tensor inside a bucket: enough for any dtype view and for vectorised copies."""


@dataclass(frozen=True, kw_only=True)
class StepTimeouts:
    """Seconds each manager step may take before it fails with ``StepTimeoutError``.

    ``setup`` covers prepare + build_topology + init_process_group (connecting peers), ``transfer`` the whole
    send/receive of one update. Generous defaults: a timeout is a last resort against a hang, not a speed target.
    """

    pause: float = 60.0
    setup: float = 120.0
    transfer: float = 600.0
    finalize: float = 60.0
    resume: float = 60.0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"timeouts.{item.name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """How an update is carried out.

    ``bucket_bytes``: size of one bucket (the unit packed, moved and unpacked); each engine keeps ``slots`` of them
    per side (2 = double buffering: one is filled while the other moves); None: the backend's own default (2, and 4
    for ``shm``, whose ring is one copy in host memory shared by every receiver). ``backend_options`` are passed to the
    backend's constructor as keywords. ``verify_digest`` makes receivers check the end-to-end digest.

    ``delta``: send only what changed since the version every replica holds (``weightsync.core.delta``): the
    sender keeps a host copy of that version (the model's size in host memory); a replica that does not hold it
    exactly gets a full update. ``verify_every``: with ``delta``, receivers hash what they hold after every
    ``verify_every``-th delta update and compare it with the sender's (1: after every one).

    ``staged``: serve while the update arrives. One worker per host (its stager) receives the whole update into
    the host's staging area in shared memory while every replica keeps serving, and checks its digest there; then
    each replica, as soon as every host it spans holds the verified update, is paused only to swap — every worker
    applies from its host's staging area into the live parameters — and resumed. Costs one staging area of the
    model's size per host (``weightsync.core.transports.stagearea``). A replica whose staging failed is never paused
    and keeps serving its old version; rollout workers that cannot stage (``StagingWorker``) are a ``ConfigError``.

    ``max_evicted``: before each update the manager pings every rollout worker; a replica with a worker that is dead
    (``WorkerDiedError``: Ray declared its actor dead) or does not answer within ``timeouts.setup`` is evicted —
    left out of the update and of the membership, named in ``UpdateReport.evicted`` — and the update goes on over
    the others, a delta still where it was one. A replica that dies during an update is evicted by the same call,
    and the survivors that lack the version get it in a second transfer (``weightsync.core.control.eviction``).
    More dead replicas than ``max_evicted`` in one update (before and during it together), or all of them, fail the
    update, evicting none; 0 turns eviction off.
    """

    bucket_bytes: int = 64 * MiB
    slots: int | None = None
    timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    backend_options: Mapping[str, JsonValue] = field(default_factory=dict)
    verify_digest: bool = True
    delta: bool = False
    verify_every: int = 1
    staged: bool = False
    max_evicted: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int):
            raise ConfigError(f"bucket_bytes must be an int, got {type(self.bucket_bytes).__name__}")
        if self.bucket_bytes < BUCKET_ALIGNMENT:
            raise ConfigError(
                f"bucket_bytes must be at least {BUCKET_ALIGNMENT} (the tensor alignment), got {self.bucket_bytes}"
            )
        if self.bucket_bytes % BUCKET_ALIGNMENT:
            raise ConfigError(f"bucket_bytes must be a multiple of {BUCKET_ALIGNMENT}, got {self.bucket_bytes}")
        if self.slots is not None and (
            isinstance(self.slots, bool) or not isinstance(self.slots, int) or not 1 <= self.slots <= 16
        ):
            raise ConfigError(f"slots must be an int between 1 and 16, got {self.slots!r}")
        for flag in ("delta", "staged", "verify_digest"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 1:
            raise ConfigError(f"verify_every must be a positive int, got {self.verify_every!r}")
        if isinstance(self.max_evicted, bool) or not isinstance(self.max_evicted, int) or self.max_evicted < 0:
            raise ConfigError(f"max_evicted must be an int of at least 0, got {self.max_evicted!r}")
        if not isinstance(self.timeouts, StepTimeouts):
            raise ConfigError("timeouts must be a StepTimeouts")
        try:
            json_safe(dict(self.backend_options))
        except TypeError as exc:
            raise ConfigError(f"backend_options must be plain data: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for handing the config to worker processes."""
        data = dataclasses.asdict(self)
        data["backend_options"] = dict(self.backend_options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncConfig:
        known = {item.name for item in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown SyncConfig fields: {', '.join(unknown)}")
        values = dict(data)
        if isinstance(values.get("timeouts"), Mapping):
            values["timeouts"] = StepTimeouts(**values["timeouts"])
        return cls(**values)
