"""weightsync engines as verl ``CheckpointEngine`` classes, registered as ``weightsync.<name>``.

verl builds one checkpoint engine per worker process from its config — ``CheckpointEngineRegistry.new(backend,
bucket_size=..., is_master=..., **engine_kwargs)`` on actor ranks, the same without ``is_master`` in each rollout
worker's ``CheckpointEngineWorker`` — and drives it with its own calling conventions (positional
``build_topology``, ``send_weights(weights, global_steps=...)``, ``receive_weights(global_steps=...)`` returning an
async iterator, ``init_process_group(**kwargs)`` with whatever ``build_topology`` decided). ``VerlCheckpointEngine``
maps those conventions onto one weightsync engine (any ``CheckpointEngine``, built by name from the registry) and
onto our keyword-only API. It serves two drivers:

* verl's own ``CheckpointEngineManager``: every update runs prepare → build_topology → init_process_group →
  send/receive → finalize; prepare reuses the engine (and its buckets), init_process_group starts a new epoch.
* weightsync's manager (``weightsync.verl.CheckpointEngineManager``), which reaches the same object through the
  worker's ``execute_checkpoint_engine``: it passes ``prepare(engine=spec)`` (the plain-data spec of
  ``weightsync.core.engine_spec``, with the worker's global rank), skips setup while membership is unchanged, and
  collects each worker's :class:`TransferReport` through :meth:`VerlCheckpointEngine.transfer_report`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, cast

import torch
from verl.checkpoint_engine.base import CheckpointEngine as _VerlCheckpointEngineABC
from verl.checkpoint_engine.base import CheckpointEngineRegistry

from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import (
    ConfigError,
    LifecycleError,
    TopologyError,
    WeightStreamError,
    reject_renamed_keywords,
)
from weightsync.api.protocols import CheckpointEngine
from weightsync.api.registry import installed_backends, load_engine_class
from weightsync.api.topology import build_checked_topology, with_epoch
from weightsync.api.types import RankArgs, Role, TransferReport, WorkerMetadata, WorldMetadata
from weightsync.core.control.auto import AUTO
from weightsync.core.transports.place import default_node_id, ping_answer
from weightsync.core.worker.host import EngineSlot, build_engine, engine_spec

__all__ = [
    "REGISTRY_PREFIX",
    "VerlCheckpointEngine",
    "engine_class_for",
    "register_backends",
    "sync_config_from_engine_kwargs",
    "report_from_dict",
]

REGISTRY_PREFIX = "weightsync."
"""verl registry names are ``weightsync.<backend>``: verl's own ``nccl``/``nixl``/... keep their names."""

# engine_kwargs keys that configure the pipeline (SyncConfig) rather than the backend's own constructor options.
_SYNC_KEYS = frozenset({"slots", "verify_digest", "timeouts", "delta", "verify_every"})


def sync_config_from_engine_kwargs(*, bucket_bytes: int, engine_kwargs: Mapping[str, Any]) -> SyncConfig:
    """The ``SyncConfig`` a verl checkpoint-engine config describes.

    Both the engines (built by verl in each worker) and weightsync's manager (built by verl's trainer) derive their
    configuration here from the same verl config, so the manager's ``prepare(engine=spec)`` matches what the
    workers already built and reuses it.
    """
    options = dict(engine_kwargs)
    reject_renamed_keywords("verl engine_kwargs", options)
    if "staged" in options:
        raise ConfigError("engine_kwargs staged: a staged update needs rollout workers that stage it while they serve "
                          "(weightsync.api.StagingWorker), and verl's rollout workers cannot; update unstaged")
    timeouts = options.pop("timeouts", None)
    if timeouts is not None and not isinstance(timeouts, (Mapping, StepTimeouts)):
        raise ConfigError(f"engine_kwargs timeouts must be a mapping of step to seconds, got {timeouts!r}")
    if isinstance(timeouts, Mapping):
        try:
            timeouts = StepTimeouts(**dict(timeouts))
        except TypeError as exc:
            raise ConfigError(f"engine_kwargs timeouts: {exc}") from None
    sync: dict[str, Any] = {key: options.pop(key) for key in sorted(_SYNC_KEYS & set(options))}
    if timeouts is not None:
        sync["timeouts"] = timeouts
    return SyncConfig(bucket_bytes=bucket_bytes, backend_options=options, **sync)


def report_from_dict(data: Mapping[str, Any]) -> TransferReport:
    """Rebuild a :class:`TransferReport` from ``TransferReport.to_dict()`` (what workers hand back as plain data)."""
    if not isinstance(data, Mapping):
        raise LifecycleError(f"expected a transfer report, got {type(data).__name__}")
    try:
        return TransferReport.from_dict(data)
    except TypeError as exc:
        raise LifecycleError(f"malformed transfer report {data!r}: {exc}") from None


def _host_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:  # not in a Ray process: peers on this host reach us on loopback
        pass
    return "127.0.0.1"


def _local_rank_guess(is_master: bool | None) -> int:
    """This worker's rank as verl knows it when it builds the engine (verl passes no rank, only ``is_master``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    if is_master:
        return 0
    # verl's RayWorkerGroup sets RANK in every worker's environment.
    return int(os.environ.get("RANK", "0"))


class _ReceiveStream:
    """What ``receive_weights`` hands verl's server adapter: weightsync's stream, plus report bookkeeping.

    verl consumes it with ``async for``; the tensors are views into the engine's receive buffer (see
    ``weightsync.api.ReceivedWeights``), valid while their bucket is being consumed — the same lifetime verl's own
    engines give. When the stream ends normally its digest has been verified and the report is kept.
    """

    def __init__(self, owner: VerlCheckpointEngine, stream: Any) -> None:
        self._owner = owner
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> _ReceiveStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        try:
            item: tuple[str, torch.Tensor] = await self._stream.__anext__()
        except StopAsyncIteration:
            self.finished = True
            self._owner._received(self._stream.report)
            raise
        except BaseException:
            self.finished = True  # the stream closed itself; nothing to abort
            raise
        return item


class VerlCheckpointEngine(_VerlCheckpointEngineABC):  # type: ignore[misc]  # verl is untyped
    """verl's ``CheckpointEngine`` contract over one weightsync engine; one subclass per backend (``backend``).

    Constructor keywords are verl's: ``bucket_size`` (bytes), ``is_master`` (passed on actor ranks only; its
    presence is how an engine knows it is on the actor side) and the backend's ``engine_kwargs`` from verl's config,
    of which ``slots``, ``verify_digest``, ``delta``, ``verify_every`` and ``timeouts`` configure the pipeline and the
    rest are the weightsync backend's own options (an unknown one is a ``ConfigError`` here, at construction).
    """

    backend: ClassVar[str] = ""
    """The weightsync registry name this class hosts (``"shm"`` for verl's ``weightsync.shm``)."""
    wire_format: ClassVar[str] = "named_tensors"

    def __init__(self, *, bucket_size: int, is_master: bool | None = None, **engine_kwargs: Any) -> None:
        if not self.backend:
            raise ConfigError("VerlCheckpointEngine is abstract: use engine_class_for(name) or verl's registry")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
            raise ConfigError(f"bucket_size must be an int number of bytes, got {bucket_size!r}")
        self.config = sync_config_from_engine_kwargs(bucket_bytes=bucket_size, engine_kwargs=engine_kwargs)
        role: Role = "rollout" if is_master is None else "actor"
        rank = _local_rank_guess(is_master)
        if role == "actor" and bool(is_master) != (rank == 0):
            raise ConfigError(f"is_master={is_master} but this actor process has rank {rank}")
        self.is_master = is_master
        # ``auto`` has no engine of its own: weightsync's manager picks one from every worker's node at prepare.
        self._default_spec = (None if self.backend == AUTO else
                              engine_spec(backend=self.backend, config=self.config, role=role, rank=rank))
        self._lock = threading.RLock()
        self._slot = EngineSlot(self._build)
        self._stream: _ReceiveStream | None = None
        self._report: TransferReport | None = None
        # Built now, so that an unknown option or an unusable backend fails while verl builds its workers.
        if self._default_spec is not None:
            self._ensure(self._default_spec)

    # -- engine lifetime -------------------------------------------------------------------------------------------

    def _ensure(self, spec: Mapping[str, Any]) -> CheckpointEngine:
        with self._lock:
            return self._slot.ensure(spec)

    def _build(self, spec: Mapping[str, Any]) -> CheckpointEngine:
        return build_engine(spec, node_id=default_node_id(), host_ip=_host_ip())

    def _drop_engine(self) -> None:
        self._stream = None
        self._slot.drop()

    def _current(self) -> CheckpointEngine:
        engine = self._slot.engine
        if engine is None:
            raise LifecycleError(f"weightsync.{self.backend}: no engine (prepare was not called after an abort)")
        return engine

    def _abandoned_stream(self) -> None:
        # A consumer that raised mid-update left its stream open; the engine may be mid-message, so rebuild it.
        if self._stream is not None and not self._stream.finished:
            self.abort()

    # -- verl's CheckpointEngine contract ----------------------------------------------------------------------------

    def prepare(self, engine: Mapping[str, Any] | None = None) -> WorkerMetadata:
        """Step 1. ``engine`` (from weightsync's manager) names backend, config, role and global rank; verl's own
        manager passes nothing and the engine built from verl's constructor arguments is used."""
        spec = engine if engine is not None else self._default_spec
        if spec is None:
            raise _auto_needs_our_manager()
        with self._lock:
            self._abandoned_stream()
            return self._ensure(spec).prepare()

    def ping(self) -> dict[str, Any]:
        """Where this worker runs: weightsync's manager picks ``auto``'s backend from every worker's node, and
        names the hosts it cannot reach when an update times out."""
        return ping_answer(node_id=default_node_id(), host_ip=_host_ip())

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: Sequence[WorkerMetadata]
    ) -> tuple[dict[str, list[RankArgs]], dict[str, list[RankArgs]]]:
        """Step 2, verl's positional call. Forwards by keyword to the weightsync backend and returns verl's shape:
        one ``{"rank_args": [...]}`` per side, each list as long as that side's world size."""
        if cls.backend == AUTO:
            raise _auto_needs_our_manager()
        sizes = (actor_wg_world_size, rollout_world_size)
        if all(isinstance(size, int) and size >= 0 for size in sizes) and len(metadata) != sum(sizes):
            # verl passes one flat list; build_checked_topology checks sizes and each side of the split.
            raise TopologyError(f"got metadata for {len(metadata)} workers but actor_wg_world_size + "
                                f"rollout_world_size is {sum(sizes)}")
        split = actor_wg_world_size if isinstance(actor_wg_world_size, int) else 0
        topology = build_checked_topology(
            load_engine_class(cls.backend), backend=cls.backend, actor_wg_world_size=actor_wg_world_size,
            rollout_world_size=rollout_world_size,
            metadata=WorldMetadata(actor=list(metadata[:split]), rollout=list(metadata[split:])),
        )
        # verl has no epoch of its own: each build_topology call starts one, as weightsync's manager does.
        topology = with_epoch(topology)
        return {"rank_args": list(topology.actor)}, {"rank_args": list(topology.rollout)}

    def init_process_group(self, rank_args: RankArgs) -> None:
        """Step 3 (verl calls it with the keywords ``build_topology`` returned: ``rank_args``)."""
        with self._lock:
            self._abandoned_stream()
            self._current().init_process_group(rank_args=rank_args)

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None
                           ) -> dict[str, float]:
        """Step 4, actor side. Returns verl-style metrics (empty on ranks that only drained their weights, so
        they do not overwrite the sender's when verl's manager merges the ranks' dicts)."""
        if not hasattr(weights, "__iter__") and hasattr(weights, "__anext__"):
            raise WeightStreamError(
                "weightsync engines take the weights as a synchronous iterable of (name, tensor); got an async "
                "iterator (the pipeline plans buckets while the stream is drained, on the caller's thread)"
            )
        self._report = None
        report = await self._current().send_weights(weights, version=_version(global_steps))
        self._report = report
        if not report.digest:
            return {}
        metrics = {
            "weightsync/send_bytes": float(report.nbytes),
            "weightsync/send_seconds": report.seconds,
            "weightsync/send_buckets": float(report.buckets),
        }
        metrics.update({f"weightsync/send_{phase.phase}_seconds": phase.seconds for phase in report.phases})
        return metrics

    def receive_weights(self, global_steps: int | None = None) -> _ReceiveStream:
        """Step 4, rollout side: the stream verl's ``CheckpointEngineWorker`` hands its server adapter.

        Not a coroutine: verl calls it without ``await`` and iterates the result with ``async for``.
        """
        del global_steps  # the version travels in the bucket headers, from the sender
        with self._lock:
            self._abandoned_stream()
            self._report = None
            self._stream = _ReceiveStream(self, self._current().receive_weights())
            return self._stream

    def _received(self, report: TransferReport | None) -> None:
        self._report = report

    def finalize(self) -> None:
        """Step 5: per-update state only; buckets and connections stay for the next update of this epoch."""
        with self._lock:
            engine = self._slot.engine
            if engine is not None:
                engine.finalize()

    # -- beyond verl's contract (reached through execute_checkpoint_engine) ------------------------------------------

    def transfer_report(self) -> dict[str, Any]:
        """This worker's report of the last update, as plain data (weightsync's manager checks digests with it)."""
        report = self._report
        if report is None:
            raise LifecycleError(
                f"weightsync.{self.backend}: no transfer report; the last update did not complete on this worker "
                "(on a rollout worker: its server adapter stopped consuming the weights before the end)"
            )
        return report.to_dict()

    def abort(self) -> None:
        """Drop the engine after a failed update: its connections close, so peers fail now instead of at their
        deadline (a sender waits for every receiver to acknowledge each bucket). The next ``prepare`` rebuilds it."""
        with self._lock:
            self._report = None
            self._drop_engine()

    def close(self) -> None:
        with self._lock:
            self._drop_engine()


def _auto_needs_our_manager() -> ConfigError:
    return ConfigError(
        f"{REGISTRY_PREFIX}{AUTO} picks its backend from every worker's node, which weightsync's manager "
        f"(actor_rollout_ref.rollout.checkpoint_manager_class=weightsync.verl.CheckpointEngineManager) asks for; "
        f"verl's own manager cannot: name a backend ({REGISTRY_PREFIX}shm, {REGISTRY_PREFIX}nixl, ...) or use "
        "weightsync's manager"
    )


def _version(global_steps: int | None) -> int:
    if global_steps is None:
        return 0
    if isinstance(global_steps, bool) or not isinstance(global_steps, int):
        raise ConfigError(f"global_steps must be an int, got {global_steps!r}")
    return global_steps


# -- registration in verl's CheckpointEngineRegistry -----------------------------------------------------------------

_classes: dict[str, type[VerlCheckpointEngine]] = {}
_classes_lock = threading.Lock()


def engine_class_for(name: str) -> type[VerlCheckpointEngine]:
    """The verl engine class hosting weightsync backend ``name`` (one class per backend, created once)."""
    with _classes_lock:
        cls = _classes.get(name)
        if cls is None:
            class_name = "Verl" + "".join(part.capitalize() for part in name.replace("-", "_").split("_")) + "Engine"
            cls = cast(type[VerlCheckpointEngine], type(class_name, (VerlCheckpointEngine,), {
                "backend": name, "__module__": __name__, "__qualname__": class_name,
                "__doc__": f"verl's ``{REGISTRY_PREFIX}{name}``: the weightsync ``{name}`` backend.",
            }))
            # Module-level name: the class is importable by reference (what pickle and Ray's logs use).
            globals()[class_name] = cls
            _classes[name] = cls
        return cls


def register_backends() -> list[str]:
    """Register every installed weightsync backend in verl's registry as ``weightsync.<name>``; idempotent.

    A name already registered by this adapter (even by an earlier import of this module, after a reload) is left
    as it is; a name taken by anything else is a ``ConfigError``. Returns the verl names registered.
    """
    registry: dict[str, Any] = CheckpointEngineRegistry._registry
    names = []
    for backend in (*installed_backends(), AUTO):
        verl_name = REGISTRY_PREFIX + backend
        existing = registry.get(verl_name)
        if existing is not None:
            if getattr(existing, "backend", None) != backend or not hasattr(existing, "transfer_report"):
                raise ConfigError(f"verl's checkpoint-engine name {verl_name!r} is already taken by {existing!r}")
        else:
            CheckpointEngineRegistry.register(verl_name)(engine_class_for(backend))
        names.append(verl_name)
    return names
