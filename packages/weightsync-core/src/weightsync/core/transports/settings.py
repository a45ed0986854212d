"""What every engine is built with: its settings, parsed and validated once, and the metadata every worker shares.

The engine (``weightsync.core.worker.engine``) and engines that implement the ``CheckpointEngine`` Protocol themselves
(kimi) both start here, so option checking and the common metadata are written once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import msgspec
import torch

from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConfigError, LifecycleError, reject_renamed_keywords
from weightsync.api.types import WorkerContext, WorkerMetadata
from weightsync.core.transports.place import Place, default_node_id, here, local_rail, rail_devices

__all__ = ["EngineBase", "EngineMetadata", "EngineSettings", "PackHook", "ReceiveHook", "TransportHook",
           "load_transport_hook"]


@runtime_checkable
class PackHook(Protocol):
    def after_pack(self, index: int, payload: torch.Tensor) -> None:
        """On the sender after a bucket is packed and before it is hashed (a fault the digest cannot see: only a
        byte-level comparison catches it). May mutate ``payload``."""
        ...


@runtime_checkable
class ReceiveHook(Protocol):
    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        """On a receiver after the bucket arrived and before it is hashed (corruption in transit: the digest
        catches it). May mutate ``payload``."""
        ...


TransportHook = PackHook | ReceiveHook
"""Test hook (engine option ``transport_hook="module:attribute"``) to corrupt buckets deliberately: either hook, or
both; the settings give the pipeline each one it has (``EngineSettings.after_pack`` / ``after_receive``)."""


class EngineMetadata(Place, kw_only=True, frozen=True):
    """What every worker of every backend advertises in ``prepare`` (:meth:`EngineSettings.metadata`): where it runs
    (:class:`~weightsync.core.transports.place.Place`), which engine it is and how it is configured; a transport
    adds keys of its own, read by a struct derived from this one."""

    backend: str = ""
    role: str = ""
    rank: int = 0
    bucket_bytes: int = 0
    slots: int = 0
    staged: bool = False
    """Part of staged updates: a topology may give each host's stagers their part of the update
    (:mod:`weightsync.core.transports.chain.stripes`)."""


def load_transport_hook(spec: str | None) -> TransportHook | None:
    if spec is None:
        return None
    module_name, _, attribute = spec.partition(":")
    try:
        hook: TransportHook = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"transport_hook {spec!r} cannot be loaded: {exc}") from None
    if not isinstance(hook, (PackHook, ReceiveHook)):
        raise ConfigError(f"transport_hook {spec!r} has neither after_pack nor after_receive")
    return hook


@dataclass(frozen=True)
class EngineSettings:
    """One engine's settings, validated as they are made (``ConfigError`` for anything invalid); every engine builds
    them once from its constructor's keywords (:class:`EngineBase`).

    Options common to every backend: ``context`` (``WorkerContext``, from the host), ``slots`` (buckets per side),
    ``timeout`` (seconds any single blocking wait may take), ``verify_digest``, ``delta``, ``verify_every`` and
    ``staged`` (``SyncConfig``'s), ``hook`` (``transport_hook``, tests only).
    A backend's own options arrive in ``options``, checked against the names it declares (``option_names``).
    """

    name: str
    bucket_bytes: int
    slots: int
    timeout: float
    verify_digest: bool
    context: WorkerContext
    delta: bool = False
    verify_every: int = 1
    staged: bool = False
    """Part of staged updates: advertised in the metadata (``staged``), so a topology can give each host's stagers
    their part of the update (:mod:`weightsync.core.transports.chain.stripes`)."""
    options: dict[str, Any] = field(default_factory=dict)
    hook: TransportHook | None = None
    option_names: frozenset[str] = frozenset()
    after_pack: Callable[[int, torch.Tensor], None] | None = field(init=False, default=None)
    """The test hook's ``after_pack``, if it has one (and ``after_receive`` likewise)."""
    after_receive: Callable[[int, torch.Tensor], None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "after_pack", self.hook.after_pack if isinstance(self.hook, PackHook) else None)
        object.__setattr__(self, "after_receive",
                           self.hook.after_receive if isinstance(self.hook, ReceiveHook) else None)
        unknown = sorted(set(self.options) - self.option_names)
        if unknown:
            accepted = ", ".join(sorted(self.option_names)) or "none"
            raise ConfigError(f"{self.name} engine got unknown options {unknown}; its own options: {accepted}")
        # validates these, raising ConfigError
        SyncConfig(bucket_bytes=self.bucket_bytes, slots=self.slots, delta=self.delta, verify_every=self.verify_every)
        timeout = self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        object.__setattr__(self, "timeout", float(timeout))

    def metadata(self) -> WorkerMetadata:
        """What every worker of every backend advertises in ``prepare()`` (:class:`EngineMetadata`); a backend adds
        its own keys."""
        place = here(node_id=self.context.node_id, host_ip=self.context.host_ip)
        metadata: WorkerMetadata = msgspec.to_builtins(EngineMetadata(
            backend=self.name, role=self.context.role, rank=self.context.rank, bucket_bytes=self.bucket_bytes,
            slots=self.slots, staged=self.staged, **msgspec.structs.asdict(place)))
        return metadata

    @property
    def rail_address(self) -> str:
        """Where this worker's weight traffic goes out and comes in: its rail's address (``local_rail``), its
        ``host_ip`` on a host of one rail."""
        return local_rail(self.context.host_ip).rail_address

    @property
    def rail_devices(self) -> list[str]:
        """The devices of this worker's rail (:func:`~weightsync.core.transports.place.rail_devices`)."""
        return rail_devices(self.context.host_ip)

    @property
    def self_name(self) -> str:
        return f"{self.context.role} rank {self.context.rank}"


class EngineBase:
    """What every engine shares before its lifecycle: settings parsed once from the constructor's keywords, read
    back as attributes, and the closed flag. Engines of bucket backends and engines that implement the
    ``CheckpointEngine`` Protocol themselves (kimi) both start here."""

    name: ClassVar[str]
    option_names: ClassVar[frozenset[str]] = frozenset()
    default_slots: ClassVar[int] = 2
    supports_delta: ClassVar[bool] = True
    """Whether ``delta=True`` is accepted (bucket engines: yes; an engine without buckets to encode: no)."""
    checks_transport_rules: ClassVar[bool] = False
    """Whether ``check_transport=True`` is accepted (bucket engines: yes)."""
    verifies_parts: ClassVar[bool] = False
    """Whether rank arguments may carry the rollout workers' parts (bucket engines: yes)."""

    def __init__(self, *, bucket_bytes: int, context: WorkerContext | None = None, slots: int | None = None,
                 timeout: float = 600.0, verify_digest: bool = True, transport_hook: str | None = None,
                 delta: bool = False, verify_every: int = 1, staged: bool = False, **options: Any) -> None:
        reject_renamed_keywords(type(self).__name__, options)
        self.settings = EngineSettings(
            name=self.name, bucket_bytes=bucket_bytes, slots=slots if slots is not None else self.default_slots,
            timeout=timeout, verify_digest=verify_digest,
            context=context or WorkerContext(role="actor", rank=0, node_id=default_node_id()), delta=delta,
            verify_every=verify_every, staged=staged, options=options, hook=load_transport_hook(transport_hook),
            option_names=self.option_names)
        self._closed = False

    @property
    def bucket_bytes(self) -> int:
        return self.settings.bucket_bytes

    @property
    def slots(self) -> int:
        return self.settings.slots

    @property
    def timeout(self) -> float:
        return self.settings.timeout

    @property
    def context(self) -> WorkerContext:
        return self.settings.context

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError(f"{self.name} engine is closed")
