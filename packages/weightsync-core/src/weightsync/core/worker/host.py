"""``EngineHost``: what an adapter's worker process keeps — one engine, built from plain data sent by the driver.

Adapters (Ray actors, verl workers) forward ``execute_checkpoint_engine(method, **kwargs)`` and ``update_weights``
here. The host builds the engine named in ``prepare``'s ``engine`` argument, reuses it while the same backend and
configuration are asked for, and runs the engine's blocking steps in a thread so the worker's event loop stays free.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from weightsync.api.config import SyncConfig
from weightsync.api.errors import (
    ConfigError, LifecycleError, SharedMemoryFullError, TopologyError, WeightsyncError,
    WeightStreamError,
)
from weightsync.api.protocols import CheckpointEngine, ReceivedWeights, WeightSink
from weightsync.api.parts import PART_KEY, Part
from weightsync.api.sources import SOURCE_KEY, SourceLayout
from weightsync.api.registry import load_engine_class
from weightsync.api.types import RankArgs, Role, StagedUpdate, TransferReport, WorkerContext, WorkerMetadata
from weightsync.core.pipeline.staged import staged_weights
from weightsync.core.transports.place import ping_answer
from weightsync.core.transports.plan import decode
from weightsync.core.wire import codec
from weightsync.core.wire.partplans import PartPlan
from weightsync.core.worker.counting import CountingStream
from weightsync.core.transports.stagearea import StageArea

__all__ = ["EngineHost", "EngineSlot", "StagingEngine", "accepted_options", "build_engine", "check_planned_part",
           "engine_spec", "is_untouched", "mark_untouched", "unwrap"]

_METHODS = ("prepare", "init_process_group", "finalize", "close", "ping")
# What build_engine requires of an engine class: the CheckpointEngine Protocol's methods, build_topology class-level.
_ENGINE_METHODS = ("prepare", "init_process_group", "send_weights", "receive_weights", "finalize", "close")


def engine_spec(*, backend: str, config: SyncConfig, role: Role, rank: int) -> dict[str, Any]:
    """The plain-data ``engine`` argument of ``prepare`` for one worker."""
    return {"backend": backend, "config": config.to_dict(), "role": role, "rank": rank}


def build_engine(spec: Mapping[str, Any], *, node_id: str, host_ip: str) -> CheckpointEngine:
    """The engine an ``engine_spec`` describes, for a worker on ``node_id`` reachable at ``host_ip``.

    Any class that satisfies the ``CheckpointEngine`` Protocol will do (checked structurally, not by base class).
    """
    try:
        backend = str(spec["backend"])
        config = SyncConfig.from_dict(spec["config"])
        role: Role = "actor" if spec["role"] == "actor" else "rollout"
        rank = int(spec["rank"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"malformed engine spec {dict(spec)!r}: {exc!r}") from None
    engine_class = load_engine_class(backend)
    missing = _missing_members(engine_class)
    if missing:
        raise ConfigError(f"backend {backend!r} is not a CheckpointEngine: it lacks {', '.join(missing)}")
    context = WorkerContext(role=role, rank=rank, node_id=node_id, host_ip=host_ip)
    backend_options: dict[str, Any] = dict(config.backend_options)
    if config.delta:  # only then: an engine of another project need not know the keywords
        backend_options.update(delta=True, verify_every=config.verify_every)
    if config.staged:
        backend_options.update(staged=True)
    return engine_class(
        bucket_bytes=config.bucket_bytes, context=context, slots=config.slots, timeout=config.timeouts.transfer,
        verify_digest=config.verify_digest, **backend_options,
    )


_FROM_CONFIG = frozenset({"bucket_bytes", "context", "slots", "timeout", "verify_digest", "delta", "verify_every",
                          "staged"})
"""The keywords ``build_engine`` gives every engine itself (from ``SyncConfig``); never ``backend_options``."""


def accepted_options(engine_class: type) -> frozenset[str] | None:
    """The ``backend_options`` an engine class takes: its ``option_names`` and the keywords of its constructors
    (``transport_hook``...), less what ``build_engine`` passes itself; None for an engine that does not declare
    ``option_names`` (an engine of another project: what it takes is its own to check)."""
    names = getattr(engine_class, "option_names", None)
    if not isinstance(names, frozenset):
        return None
    keywords = {name for cls in engine_class.__mro__ if "__init__" in vars(cls)
                for name, parameter in inspect.signature(vars(cls)["__init__"]).parameters.items()
                if name != "self" and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)}
    return frozenset(names | keywords) - _FROM_CONFIG


def _missing_members(engine_class: object) -> list[str]:
    """The ``CheckpointEngine`` members ``engine_class`` lacks (``build_topology`` must be a class-level method)."""
    if not isinstance(engine_class, type):
        return ["a class"]
    missing = [name for name in _ENGINE_METHODS if not callable(getattr(engine_class, name, None))]
    if not isinstance(inspect.getattr_static(engine_class, "build_topology", None), (classmethod, staticmethod)):
        missing.append("a class-level build_topology")
    return missing


@runtime_checkable
class StagingEngine(Protocol):
    """An engine that takes part in staged updates (``SyncConfig.staged``; every bucket engine does): the stage
    phase on a host's stager, and the swap's stream read from the staging area on every worker of the host."""

    async def stage_weights(self, area: StageArea, *, version: int) -> StagedUpdate: ...

    def receive_staged(self, staged: StagedUpdate) -> ReceivedWeights: ...


@runtime_checkable
class HoldsAcrossUpdates(Protocol):
    """An engine that holds something across updates (a delta receiver's version) which the worker's next engine
    may take over when only the worker's rank or transport changed (``EngineSlot.ensure``)."""

    def held(self) -> object: ...

    def adopt_held(self, held: object) -> None: ...


@runtime_checkable
class ServesHeld(Protocol):
    """An engine whose receiver may keep a whole copy of the version it holds (a delta receiver feeding a sink that
    iterates views), which its worker can serve to a joining replica (``PeerWorker``)."""

    def held_weights(self) -> tuple[int, Iterator[tuple[str, torch.Tensor]]] | None: ...


def _held_part(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What an engine's state across updates depends on: its spec less its rank and transport (the backend and its
    options) and whether updates are staged (a staged update reaches the same receiver through the swap): the role,
    and how updates are made (bucket size, delta, ...)."""
    config = {**spec.get("config", {}), "backend_options": None, "staged": None}
    return {**spec, "rank": None, "backend": None, "config": config}


class EngineSlot:
    """Holds one engine and the spec it was built from; asking again for the same spec reuses it."""

    def __init__(self, build: Callable[[dict[str, Any]], CheckpointEngine]) -> None:
        self._build = build
        self.engine: CheckpointEngine | None = None
        self.spec: dict[str, Any] | None = None

    def ensure(self, spec: Mapping[str, Any]) -> CheckpointEngine:
        """The engine for ``spec``: the current one when its spec is equal, else a new one (the old one closed).
        When only the rank, the transport or the staging changed (a replica before this worker's left the
        membership; a catch-up epoch, unstaged, then the update's, whose backend ``auto`` picks anew), the new
        engine takes over what the old one held across updates (:class:`HoldsAcrossUpdates`): the next delta update
        stays one."""
        wanted = dict(spec)
        if self.engine is None or wanted != self.spec:
            old: object = self.engine
            carried = self.spec is not None and _held_part(self.spec) == _held_part(wanted)
            self.drop()
            self.engine = new = self._build(wanted)
            self.spec = wanted
            taker: object = new
            if carried and isinstance(old, HoldsAcrossUpdates) and isinstance(taker, HoldsAcrossUpdates):
                taker.adopt_held(old.held())
        return self.engine

    def drop(self) -> None:
        """Close the current engine, if any; the next ``ensure`` builds a new one."""
        engine, self.engine, self.spec = self.engine, None, None
        if engine is not None:
            engine.close()


class EngineHost:
    """One worker's engine. ``node_id``/``host_ip`` describe where this process runs (supplied by the adapter)."""

    def __init__(self, *, node_id: str, host_ip: str = "127.0.0.1", name: str = "", part: Part | None = None,
                 source: Callable[[], SourceLayout] | None = None) -> None:
        self.node_id = node_id
        self.host_ip = host_ip
        self.name = name
        self.part = part
        """What this rollout worker holds (``weightsync.api.parts``), declared in its ``prepare`` metadata; None:
        the whole model."""
        self.source = source
        """Of an actor rank of a sharded ``actor_wg`` (``weightsync.api.sources``): what it holds, asked at every
        ``prepare`` and declared in its metadata; None: the rank streams whole tensors."""
        self._slot = EngineSlot(self._build)
        self._peer: EngineHost | None = None
        """The engine this worker serves a joining replica with (``PeerWorker``), made at its first catch-up."""
        self._area: StageArea | None = None
        """This host's staging area, when this worker is its host's stager (made at the first stage, kept)."""
        self._staged: StagedUpdate | None = None
        """What the area holds, sealed (None while a stage writes it, or after one failed)."""

    @property
    def engine(self) -> CheckpointEngine | None:
        return self._slot.engine

    @property
    def spec(self) -> dict[str, Any] | None:
        """The ``engine_spec`` the current engine was built from (None before ``prepare``)."""
        return self._slot.spec

    async def execute(self, method: str, /, **kwargs: Any) -> Any:
        """Run lifecycle step ``method`` (one of prepare, init_process_group, finalize, close) off the loop."""
        if method == "ping":
            # Answered on the worker's event loop, never queued behind a blocking step: the manager pings workers
            # that missed a deadline to tell a host that cannot be reached from one that is merely waiting.
            if kwargs.get("probe"):  # connections that may wait a second: off the loop
                return await asyncio.to_thread(ping_answer, node_id=self.node_id, host_ip=self.host_ip,
                                               probe=list(kwargs["probe"]))
            return ping_answer(node_id=self.node_id, host_ip=self.host_ip)
        return await asyncio.to_thread(self.execute_sync, method, **kwargs)

    def execute_sync(self, method: str, /, **kwargs: Any) -> Any:
        """``execute`` for a caller that is not on an event loop and may block (a vLLM worker's RPC handler)."""
        if method not in _METHODS:
            raise ConfigError(f"unknown checkpoint-engine method {method!r}; expected one of {', '.join(_METHODS)}")
        if method == "ping":
            return ping_answer(node_id=self.node_id, host_ip=self.host_ip, probe=list(kwargs.get("probe", ())))
        handler: Callable[..., Any] = getattr(self, f"_{method}")
        return handler(**kwargs)

    def _prepare(self, *, engine: Mapping[str, Any]) -> WorkerMetadata:
        metadata = self._slot.ensure(engine).prepare()
        if self.part is not None:
            metadata = {**metadata, PART_KEY: self.part.to_dict()}
        if self.source is not None:
            metadata = {**metadata, SOURCE_KEY: self.source().to_dict()}
        return metadata

    def _build(self, spec: Mapping[str, Any]) -> CheckpointEngine:
        return build_engine(spec, node_id=self.node_id, host_ip=self.host_ip)

    def _init_process_group(self, *, rank_args: RankArgs) -> None:
        check_planned_part(rank_args, self.part, who=self.name or "worker")
        self._engine().init_process_group(rank_args=rank_args)

    def _finalize(self) -> None:
        if self.engine is not None:
            self.engine.finalize()

    def _close(self) -> None:
        self._slot.drop()
        peer, self._peer = self._peer, None
        if peer is not None:
            peer._close()
        area, self._area, self._staged = self._area, None, None
        if area is not None:
            area.close()

    def _engine(self) -> CheckpointEngine:
        if self.engine is None:
            raise LifecycleError(f"{self.name or 'worker'}: no engine yet (prepare was not called)")
        return self.engine

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> TransferReport:
        report = await self._engine().send_weights(weights, version=version)
        return self._finalized(report)

    async def execute_as_peer(self, method: str, /, **kwargs: Any) -> Any:
        """``execute`` on the engine this worker serves a catch-up with (``PeerWorker.execute_as_peer``)."""
        if self._peer is None:
            self._peer = EngineHost(node_id=self.node_id, host_ip=self.host_ip, name=f"{self.name} (as a peer)")
        return await self._peer.execute(method, **kwargs)

    async def serve(self, *, version: int) -> TransferReport:
        """Send this worker's copy of ``version`` through the peer engine (``PeerWorker.serve_weights``): the copy its
        receiver keeps, else the full update it staged last for its host (read back from the staging area, every
        byte hashed again as it is read and checked against the digest it was staged under, which is reported as
        ``model``: the manager checks it against the actor worker group's stream digest of the version). A
        ``LifecycleError`` if it holds neither, raised after an abort sent through the peer engine (its receivers
        stop waiting at once) where one is connected."""
        copy = self._copy_of(version)
        if isinstance(copy, str) or self._peer is None:
            refused = LifecycleError(f"{self.name or 'worker'} cannot serve version {version} to a joining replica: "
                                     f"{copy if isinstance(copy, str) else 'it has no catch-up engine'}")
            if self._peer is not None and self._peer.engine is not None:
                await self._peer.send(_Refusing(refused), version=version)
            raise refused
        weights, model = copy
        report = await self._peer.send(weights, version=version)
        return report if model is None else dataclasses.replace(report, model=model)

    def _copy_of(self, version: int) -> tuple[Iterator[tuple[str, torch.Tensor]], str | None] | str:
        """What this worker serves ``version`` from (``serve``), with the digest to report as ``model`` (None: the
        peer engine's own); else why it cannot."""
        engine: object = self.engine
        held = engine.held_weights() if isinstance(engine, ServesHeld) else None
        if held is not None and held[0] == version:
            return held[1], None
        staged = self._staged
        report = staged.report if staged is not None else None
        if staged is not None and report is not None and staged.version == version and report.base < 0:
            return staged_weights(staged, tables=codec.TableCache()), report.digest
        what = f"a copy of version {held[0]}" if held is not None else "no copy"
        if staged is not None:
            what += f" and staged version {staged.version}{' as a delta' if report and report.base >= 0 else ''}"
        return (f"it keeps {what} (a whole copy is kept by a delta receiver whose sink iterates views, or staged "
                "whole by a host's only stager)")

    def _finalized(self, report: TransferReport) -> TransferReport:
        """Finalize right after a successful transfer, in the same call: one round trip fewer for the manager."""
        self._finalize()
        return dataclasses.replace(report, finalized=True)

    async def receive(self, sink: WeightSink, *, version: int) -> TransferReport:
        return await self._load(sink, self._engine().receive_weights(), version=version)

    async def stage(self, *, version: int) -> StagedUpdate:
        """The stage phase on this host's stager: the update into the host's staging area (see ``StagingWorker``)."""
        if self._area is None:
            self._area = StageArea()
        self._staged = None  # the area is rewritten from here on
        try:
            staged = await self._staging_engine().stage_weights(self._area, version=version)
        except SharedMemoryFullError:
            area, self._area = self._area, None  # it holds what fitted: give it back to /dev/shm
            area.close()
            raise
        self._finalize()
        self._staged = staged
        return staged

    async def apply_staged(self, sink: WeightSink, *, staged: StagedUpdate) -> TransferReport:
        """The swap on this worker: the update staged on this host into ``sink``, as ``receive`` feeds it."""
        try:
            received = self._staging_engine().receive_staged(staged)
        except BaseException as exc:
            mark_untouched(exc)  # the area could not even be opened: nothing reached the model
            raise
        return await self._load(sink, received, version=staged.version)

    def _staging_engine(self) -> StagingEngine:
        engine = self._engine()
        if not isinstance(engine, StagingEngine):
            raise ConfigError(f"{self.name or 'worker'}: the {type(engine).__name__} engine cannot stage updates "
                              "(SyncConfig.staged needs a bucket engine: shm, gloo, tcp, nixl, mooncake, nccl, hccl)")
        return engine

    async def _load(self, sink: WeightSink, received: ReceivedWeights, *, version: int) -> TransferReport:
        stream = CountingStream(received)
        try:
            await sink.load_weights(stream, version=version)
            leftover = await stream.drain()  # a sink that stopped early: so the sender is not left waiting
            report = stream.report
            if report is None:
                raise LifecycleError(f"{self.name or 'worker'}: the weights stream ended without a report")
            if leftover:
                raise WeightStreamError(f"{self.name or 'worker'}: the sink left {leftover} tensors unconsumed")
        except BaseException as exc:
            await stream.aclose()  # let the sender and the other receivers finish without this one
            if not stream.touched(exc):
                # Nothing reached the model: it still holds what it held. The manager reads this mark.
                mark_untouched(exc)
            raise
        return self._finalized(report)


class _Refusing(Iterator[tuple[str, torch.Tensor]]):
    """A weights stream that raises ``error`` when first asked for a tensor (the sender's pipeline then aborts the
    update: its receivers stop waiting at once)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __next__(self) -> tuple[str, torch.Tensor]:
        raise self.error


def check_planned_part(rank_args: Mapping[str, Any], declared: Part | None, *, who: str) -> None:
    """A ``TopologyError`` naming ``who`` when its plan's part (``RankPlan.part``) is not the part it declared:
    the manager planned from other metadata than this worker's; nothing was connected yet."""
    planned = rank_args.get(PART_KEY)
    if planned is not None and (declared is None or PartPlan.of(declared, 0).tensors != decode(
            planned, PartPlan, who=who, what="rank_args").tensors):
        raise TopologyError(f"{who}: its plan is for another part than the one it declared (the manager planned "
                            "the update from other metadata than this worker's)", field=f"$.{PART_KEY}")


def mark_untouched(error: BaseException) -> None:
    """Record on ``error`` (surviving pickling through Ray) that the failed update wrote nothing to the model: the
    fact ``WeightsyncError.untouched`` declares; any other exception carries it as an attribute of that name
    (:func:`is_untouched` reads both)."""
    if isinstance(error, WeightsyncError):
        error.details["untouched"] = True
    error.untouched = True  # type: ignore[attr-defined]


def unwrap(error: BaseException) -> BaseException:
    """Ray wraps a remote exception; its ``cause`` is the one the worker raised."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def is_untouched(error: BaseException) -> bool:
    """Whether ``error`` (or the worker's error inside Ray's wrapper) carries :func:`mark_untouched`'s mark."""
    return any(candidate.untouched if isinstance(candidate, WeightsyncError)
               else getattr(candidate, "untouched", False) is True for candidate in (error, unwrap(error)))
