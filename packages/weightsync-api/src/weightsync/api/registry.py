"""Backend registry: names → engine classes, discovered through entry points, loaded lazily.

A distribution that provides a backend declares, in its ``pyproject.toml``::

    [project.entry-points."weightsync.backends"]
    shm = "weightsync.shm.spec:SPEC"

where ``SPEC`` is a :class:`BackendSpec`: plain data about the backend (devices, whether it crosses nodes, an
availability probe) and the dotted path of its engine class. Reading specs imports only the small ``spec`` modules,
so ``available_backends()`` and ``weightsync doctor`` stay cheap; the engine (torch, transport libraries) is
imported by :func:`load_engine_class` on first use. Every process — the driver and each Ray worker — resolves
names itself; resolution is idempotent and thread-safe.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Literal

from weightsync.api.errors import BackendUnavailableError, UnknownBackendError

if TYPE_CHECKING:
    from weightsync.api.protocols import CheckpointEngine

__all__ = [
    "ENTRY_POINT_GROUP",
    "KNOWN_BACKENDS",
    "install_hint",
    "BackendSpec",
    "BackendStatus",
    "register_backend",
    "installed_backends",
    "available_backends",
    "get_backend_spec",
    "load_engine_class",
    "backend_statuses",
]

ENTRY_POINT_GROUP = "weightsync.backends"

KNOWN_BACKENDS: dict[str, str] = {
    "shm": "weightsync-shm",
    "gloo": "weightsync-gloo",
    "nixl": "weightsync-nixl",
    "tcp": "weightsync-tcp",
    "mooncake": "weightsync-mooncake[cpu]  (or weightsync-mooncake[cuda] on GPU machines)",
    "nccl": "weightsync-nccl",
    "hccl": "weightsync-hccl",
    "kimi": "weightsync-kimi",
}
"""Every backend the project ships, with what to ``pip install`` for it: the install hint of a missing backend."""


def install_hint(name: str) -> str:
    """What installs shipped backend ``name``: its distribution from an index, and (until the distributions are
    published) the same from a checkout of weightsync, which works today."""
    wanted = KNOWN_BACKENDS[name]
    return f"pip install {wanted}; until it is on PyPI, from a checkout: pip install -e 'packages/{wanted.split()[0]}'"


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """What the registry knows about a backend without importing it."""

    name: str
    engine: str
    """``"module:Class"`` of the engine class."""
    distribution: str
    devices: frozenset[str]
    """Where the backend's buffers can live (every engine takes tensors on the host and the process's accelerator)."""
    cross_node: bool
    """Whether sender and receivers may sit on different hosts."""
    probe: Callable[[], str | None]
    """Cheap check run in the calling process: ``None`` when usable here, else the reason it is not."""
    description: str = ""


BackendState = Literal["available", "not installed", "unusable here"]


@dataclass(frozen=True, kw_only=True)
class BackendStatus:
    backend: str
    status: BackendState
    reason: str
    install: str


_lock = threading.RLock()
_specs: dict[str, BackendSpec] = {}
_scanned = False


def register_backend(spec: BackendSpec) -> None:
    """Register ``spec`` in this process (for plugins not installed as distributions, and for tests).

    Registering the same spec twice is harmless; a different spec under a taken name raises ``ValueError``.
    """
    with _lock:
        existing = _specs.get(spec.name)
        if existing is not None and existing != spec:
            raise ValueError(f"backend {spec.name!r} is already registered by {existing.distribution}")
        _specs[spec.name] = spec


def _scan() -> None:
    global _scanned
    with _lock:
        if _scanned:
            return
        for entry_point in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in _specs:
                continue
            try:
                spec = entry_point.load()
            except Exception as exc:  # a broken plugin must not hide the others
                spec = _broken_spec(entry_point.name, f"its spec failed to import: {exc!r}")
            if not isinstance(spec, BackendSpec):
                spec = _broken_spec(entry_point.name, f"entry point {entry_point.value} is not a BackendSpec")
            _specs[entry_point.name] = spec
        _scanned = True


def _broken_spec(name: str, reason: str) -> BackendSpec:
    return BackendSpec(
        name=name,
        engine="",
        distribution=KNOWN_BACKENDS.get(name, "?"),
        devices=frozenset(),
        cross_node=False,
        probe=lambda: reason,
    )


def installed_backends() -> list[str]:
    """Names of every backend whose distribution is installed, sorted."""
    _scan()
    with _lock:
        return sorted(_specs)


def available_backends() -> list[str]:
    """Names of installed backends whose probe says they can run in this process, sorted."""
    return [name for name in installed_backends() if _specs[name].probe() is None]


def get_backend_spec(name: str) -> BackendSpec:
    """The spec of backend ``name``; ``UnknownBackendError`` (naming what to install) when it is not installed."""
    if not isinstance(name, str) or not name:
        raise UnknownBackendError(f"backend name must be a non-empty string, got {name!r}", backend=str(name),
                                  install="")
    _scan()
    with _lock:
        spec = _specs.get(name)
    if spec is None:
        install = KNOWN_BACKENDS.get(name)
        if install is None:
            known = ", ".join(sorted(set(KNOWN_BACKENDS) | set(installed_backends())))
            raise UnknownBackendError(
                f"unknown weightsync backend {name!r}; known backends: {known}", backend=name, install=""
            )
        raise UnknownBackendError(
            f"weightsync backend {name!r} is not installed; install it with: {install_hint(name)}",
            backend=name,
            install=install,
        )
    return spec


def load_engine_class(name: str) -> type[CheckpointEngine]:
    """Import and return the engine class of backend ``name``.

    Raises ``UnknownBackendError`` when it is not installed and ``BackendUnavailableError`` when its probe fails or
    its module does not import here (a library that does not load without a GPU driver, say).
    """
    spec = get_backend_spec(name)
    reason = spec.probe()
    if reason is not None:
        raise BackendUnavailableError(
            f"weightsync backend {name!r} cannot run here: {reason}", backend=name, reason=reason
        )
    module_name, _, attribute = spec.engine.partition(":")
    try:
        module = importlib.import_module(module_name)
        engine_class: type[CheckpointEngine] = getattr(module, attribute)
    except (ImportError, AttributeError, OSError) as exc:
        raise BackendUnavailableError(
            f"weightsync backend {name!r} failed to load {spec.engine}: {exc}", backend=name, reason=str(exc)
        ) from exc
    return engine_class


def backend_statuses() -> list[BackendStatus]:
    """One status per known or installed backend (what ``weightsync doctor`` prints)."""
    _scan()
    statuses = []
    for name in sorted(set(KNOWN_BACKENDS) | set(installed_backends())):
        install = install_hint(name) if name in KNOWN_BACKENDS else ""
        with _lock:
            spec = _specs.get(name)
        if spec is None:
            statuses.append(BackendStatus(backend=name, status="not installed", reason="", install=install))
            continue
        try:
            reason = spec.probe()
        except Exception as exc:  # a probe must not take doctor down
            reason = f"probe failed: {exc!r}"
        if reason is None:
            statuses.append(BackendStatus(backend=name, status="available", reason="", install=install))
        else:
            statuses.append(BackendStatus(backend=name, status="unusable here", reason=reason, install=install))
    return statuses


def nvidia_driver_present() -> bool:
    """Probe helper: whether this machine shows any sign of an NVIDIA driver (checked without importing torch), so
    a CUDA backend's probe can answer on a CPU-only machine without importing anything heavy."""
    import ctypes.util
    import os

    return (os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")
            or ctypes.util.find_library("cuda") is not None)


def module_importable(*modules: str) -> str | None:
    """Probe helper: ``None`` when every module can be found, else which one is missing (without importing it)."""
    from importlib.util import find_spec

    for module in modules:
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"Python module {module!r} is not installed"
    return None
