"""The Ray actors and the driver-side handles that satisfy weightsync's Protocols."""

from __future__ import annotations

import asyncio
import os
import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ray

from weightsync.api.errors import ConfigError, WorkerDiedError
from weightsync.api.parts import Part
from weightsync.api.protocols import WeightSink, WeightSource
from weightsync.api.sources import ShardedWeightSource
from weightsync.api.types import StagedUpdate, TransferReport
from weightsync.core.transports.place import LOCAL_RANK_ENV
from weightsync.core.worker.host import EngineHost

__all__ = ["ActorRankHost", "RolloutWorkerHost", "RayActorWorkerGroup", "RayRolloutWorker", "RayRolloutReplica",
           "RayHostWorker", "RayStagingWorker", "actor_options", "worker_answer"]

SourceFactory = Callable[[int, int], WeightSource]
"""Builds rank ``rank``'s weight source inside its actor: ``factory(rank, world_size)``."""
SinkFactory = Callable[[int, int], WeightSink]
"""Builds a rollout worker's sink inside its actor: ``factory(replica_index, worker_index)``."""

_PAUSE_HOOKS = ("abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation")


def _host(name: str, part: Part | None = None) -> EngineHost:
    context = ray.get_runtime_context()
    return EngineHost(node_id=context.get_node_id(), host_ip=ray.util.get_node_ip_address(), name=name, part=part)


async def _invoke(target: object, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call a user method: coroutines are awaited, plain functions run in a thread (they may train a model)."""
    function = getattr(target, method, None)
    if function is None or method.startswith("_"):
        raise ConfigError(f"{type(target).__name__} has no public method {method!r}")
    if inspect.iscoroutinefunction(function):
        return await function(*args, **kwargs)
    return await asyncio.to_thread(function, *args, **kwargs)


class ActorRankHost:
    """Body of one actor-rank Ray actor: the rank's weight source plus its engine."""

    def __init__(self, *, rank: int, world_size: int, source_factory: SourceFactory, local_rank: int | None = None
                 ) -> None:
        if local_rank is not None:
            _set_local_rank(local_rank)
        self.rank = rank
        self.host = _host(f"actor rank {rank}")
        self.source = source_factory(rank, world_size)
        if isinstance(self.source, ShardedWeightSource):  # its layout goes into every prepare's metadata
            self.host.source = self.source.source_layout

    async def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return await self.host.execute(method, **kwargs)

    async def update_weights(self, *, version: int) -> TransferReport:
        return await self.host.send(self.source.named_weights(), version=version)

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return await _invoke(self.source, method, *args, **kwargs)

    def node_id(self) -> str:
        return self.host.node_id

    def set_local_rank(self, local_rank: int) -> None:
        _set_local_rank(local_rank)


def _set_local_rank(local_rank: int) -> None:
    """This actor's ``LOCAL_RANK``, read when its engine describes itself (its rail: ``local_rail``)."""
    os.environ[LOCAL_RANK_ENV] = str(local_rank)


def _local_ranks(given: Sequence[int] | None, nodes: Sequence[str | None]) -> list[int] | None:
    """Each actor's local rank where it is known before the actors start: ``given``, or, every actor placed on a
    named node, its index among them on its node; None where Ray places them (:func:`_assign_local_ranks` then)."""
    if given is not None:
        return list(given)
    if any(node is None for node in nodes):
        return None
    return [list(nodes[:index]).count(node) for index, node in enumerate(nodes)]


def _assign_local_ranks(handles: Sequence[Any]) -> None:
    """Tell each actor Ray placed its local rank, its index among ``handles`` on the same node (which waits for the
    actors to start). Where the ranks are known before, each actor takes its own as an argument, and a group is
    made without waiting for its processes, which then start side by side."""
    nodes = ray.get([handle.node_id.remote() for handle in handles])
    ray.get([handle.set_local_rank.remote(nodes[:index].count(node)) for index, (handle, node)
             in enumerate(zip(handles, nodes))])


class RolloutWorkerHost:
    """Body of one rollout-worker Ray actor: the worker's sink plus its engine."""

    def __init__(self, *, replica: int, worker: int, sink_factory: SinkFactory, part: Part | None = None,
                 local_rank: int | None = None) -> None:
        if local_rank is not None:
            _set_local_rank(local_rank)
        self.host = _host(f"replica{replica}/worker{worker}", part)
        self.sink = sink_factory(replica, worker)

    async def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return await self.host.execute(method, **kwargs)

    async def update_weights(self, *, version: int) -> TransferReport:
        return await self.host.receive(self.sink, version=version)

    async def execute_as_peer(self, method: str, /, **kwargs: Any) -> Any:
        return await self.host.execute_as_peer(method, **kwargs)

    async def serve_weights(self, *, version: int) -> TransferReport:
        return await self.host.serve(version=version)

    async def stage_weights(self, *, version: int) -> StagedUpdate:
        return await self.host.stage(version=version)

    async def apply_staged(self, *, version: int, staged: StagedUpdate) -> TransferReport:
        if staged.version != version:
            raise ConfigError(f"apply_staged of version {version} was handed version {staged.version}'s staging")
        return await self.host.apply_staged(self.sink, staged=staged)

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return await _invoke(self.sink, method, *args, **kwargs)

    async def pause_hook(self, *hooks: str) -> None:
        """Forward replica pause/resume hooks, in order, to the sink where it implements them (an inference engine
        does)."""
        unknown = [hook for hook in hooks if hook not in _PAUSE_HOOKS]
        if unknown:
            raise ConfigError(f"unknown replica hooks {unknown}")
        for hook in hooks:
            if hasattr(self.sink, hook):
                await _invoke(self.sink, hook)

    def node_id(self) -> str:
        return self.host.node_id

    def set_local_rank(self, local_rank: int) -> None:
        _set_local_rank(local_rank)


def actor_options(ray_options: Mapping[str, Any] | None, node_id: str | None) -> dict[str, Any]:
    """Ray options for a host actor: no CPUs reserved, many concurrent calls, pinned to ``node_id`` if given;
    ``ray_options`` win."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 64}
    options.update(ray_options or {})
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return options


def _close_then_kill(handles: Sequence[Any], timeout: float = 15.0) -> None:
    # Synchronous on purpose: shutdown is called outside any event loop, after the last update.
    refs = [handle.execute_checkpoint_engine.remote("close") for handle in handles]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)
    finally:
        for handle in handles:
            ray.kill(handle)


class RayActorWorkerGroup:
    """``ActorWorkerGroup`` over Ray actors, one per rank (``ActorRankHost``)."""

    def __init__(self, handles: Sequence[Any]) -> None:
        if not handles:
            raise ConfigError("an actor worker group needs at least one rank")
        self.handles = list(handles)

    @classmethod
    def create(
        cls,
        *,
        world_size: int,
        source_factory: SourceFactory,
        node_id: str | Sequence[str] | None = None,
        ray_options: Mapping[str, Any] | None = None,
    ) -> RayActorWorkerGroup:
        """``world_size`` ranks, each building its source with ``source_factory(rank, world_size)``, pinned to Ray
        node ``node_id`` — or rank r to ``node_id[r]`` (a trainer spanning hosts)."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        nodes = [node_id] * world_size if node_id is None or isinstance(node_id, str) else list(node_id)
        if len(nodes) != world_size:
            raise ConfigError(f"node_id lists {len(nodes)} nodes for {world_size} ranks")
        remote = ray.remote(ActorRankHost)
        # Rank r's rail: its index among the ranks on its node, mod the rails.
        local_ranks = _local_ranks(None, nodes)
        handles = [
            remote.options(**actor_options(ray_options, nodes[rank])).remote(
                rank=rank, world_size=world_size, source_factory=source_factory,
                local_rank=local_ranks[rank] if local_ranks is not None else None,
            )
            for rank in range(world_size)
        ]
        if local_ranks is None:
            _assign_local_ranks(handles)
        return cls(handles)

    @property
    def world_size(self) -> int:
        return len(self.handles)

    def execute_checkpoint_engine(self, method: str, /, **per_rank_kwargs: Sequence[Any]) -> list[Any]:
        for key, values in per_rank_kwargs.items():
            if len(values) != self.world_size:
                raise ConfigError(f"{key} has {len(values)} entries for {self.world_size} ranks")
        return [
            handle.execute_checkpoint_engine.remote(method, **{key: values[rank] for key, values in
                                                               per_rank_kwargs.items()})
            for rank, handle in enumerate(self.handles)
        ]

    def update_weights(self, *, version: int) -> list[Any]:
        return [handle.update_weights.remote(version=version) for handle in self.handles]

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` of every rank's source object; one ObjectRef per rank."""
        return [handle.call.remote(method, *args, **kwargs) for handle in self.handles]

    def shutdown(self) -> None:
        """Close every rank's engine (unlinking what it allocated), then end the actors."""
        _close_then_kill(self.handles)


class RayRolloutWorker:
    """``RolloutWorker`` over one ``RolloutWorkerHost`` actor."""

    def __init__(self, handle: Any, *, name: str = "") -> None:
        self.handle = handle
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return worker_answer(self.handle.execute_checkpoint_engine.remote(method, **kwargs), self._name)

    def update_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.update_weights.remote(version=version), self._name)

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return self.handle.call.remote(method, *args, **kwargs)


async def worker_answer(ref: Any, name: str) -> Any:
    """A worker's answer to a call; an actor Ray declared dead (its process is gone) is a ``WorkerDiedError``, not a
    failure of the call."""
    try:
        return await ref
    except ray.exceptions.ActorDiedError as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise WorkerDiedError(f"Ray declared the actor dead ({said})", worker=name, step="") from exc


class RayStagingWorker(RayRolloutWorker):
    """A ``RayRolloutWorker`` whose actor (``RolloutWorkerHost``) also takes part in staged updates
    (``StagingWorker``); ``RayRolloutReplica.create`` makes these. An actor without ``stage_weights`` /
    ``apply_staged`` is wrapped in a plain ``RayRolloutWorker``, which a staged manager
    refuses with a ``ConfigError`` before anything moves."""

    def stage_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.stage_weights.remote(version=version), self.name)

    def apply_staged(self, *, version: int, staged: StagedUpdate) -> Any:
        return worker_answer(self.handle.apply_staged.remote(version=version, staged=staged), self.name)


class RayHostWorker(RayStagingWorker):
    """The worker ``RayRolloutReplica.create`` makes (over a ``RolloutWorkerHost``): it stages, and it serves a
    replica that joins the version it holds (``weightsync.api.peers.PeerWorker``)."""

    def execute_as_peer(self, method: str, /, **kwargs: Any) -> Any:
        return worker_answer(self.handle.execute_as_peer.remote(method, **kwargs), self.name)

    def serve_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.serve_weights.remote(version=version), self.name)


class RayRolloutReplica:
    """``RolloutReplica`` over Ray actors, one per worker; pause hooks are forwarded to every worker's sink."""

    def __init__(self, workers: Sequence[RayRolloutWorker]) -> None:
        if not workers:
            raise ConfigError("a replica needs at least one worker")
        self._workers = list(workers)

    @classmethod
    def create(
        cls,
        *,
        replica: int,
        sink_factory: SinkFactory,
        num_workers: int = 1,
        node_id: str | Sequence[str] | None = None,
        ray_options: Mapping[str, Any] | None = None,
        local_ranks: Sequence[int] | None = None,
        parts: Sequence[Part | None] | None = None,
    ) -> RayRolloutReplica:
        """``num_workers`` workers, pinned to Ray node ``node_id`` — or worker i to ``node_id[i]`` (a replica
        spanning nodes, e.g. tensor parallelism across hosts). Worker i's ``LOCAL_RANK`` (its rail on a host of
        several: ``local_rail``) is ``local_ranks[i]``, by default its index among the replica's workers on its
        node; give ``local_ranks`` where several replicas share a node. Worker i holds ``parts[i]`` of the model
        (``weightsync.api.parts``: it reads and verifies only those regions of each update), by default the
        whole."""
        if local_ranks is not None and len(local_ranks) != num_workers:
            raise ConfigError(f"local_ranks lists {len(local_ranks)} ranks for {num_workers} workers")
        if parts is not None and (len(parts) != num_workers
                                  or not all(part is None or isinstance(part, Part) for part in parts)):
            raise ConfigError(f"parts must list a Part (or None) for each of the {num_workers} workers, got {parts!r:.200}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"num_workers must be a positive int, got {num_workers!r}")
        nodes = [node_id] * num_workers if node_id is None or isinstance(node_id, str) else list(node_id)
        if len(nodes) != num_workers:
            raise ConfigError(f"node_id lists {len(nodes)} nodes for {num_workers} workers")
        remote = ray.remote(RolloutWorkerHost)
        known = _local_ranks(local_ranks, nodes)
        workers: list[RayRolloutWorker] = [
            RayHostWorker(
                remote.options(**actor_options(ray_options, node)).remote(
                    replica=replica, worker=worker, sink_factory=sink_factory,
                    part=parts[worker] if parts is not None else None,
                    local_rank=known[worker] if known is not None else None,
                ),
                name=f"worker{worker}",
            )
            for worker, node in enumerate(nodes)
        ]
        if known is None:
            _assign_local_ranks([worker.handle for worker in workers])
        return cls(workers)

    @property
    def workers(self) -> list[RayRolloutWorker]:
        return list(self._workers)

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> list[Any]:
        return [worker.call(method, *args, **kwargs) for worker in self._workers]

    async def _hook(self, *hooks: str) -> None:
        refs: list[Awaitable[None]] = [worker.handle.pause_hook.remote(*hooks) for worker in self._workers]
        await asyncio.gather(*refs)

    async def _hooks(self, first: str, second: str) -> None:
        """``first`` on every worker, then ``second``: one round trip when the replica has a single worker; with
        several, two, so that no worker runs ``second`` before every worker ran ``first`` (a tensor-parallel
        engine must stop generating on all its workers before any of them drops its KV cache)."""
        if len(self._workers) == 1:
            await self._hook(first, second)
        else:
            await self._hook(first)
            await self._hook(second)

    async def pause(self) -> None:
        await self._hooks("abort_all_requests", "release_kv_cache")

    async def resume(self) -> None:
        await self._hooks("resume_kv_cache", "resume_generation")

    async def abort_all_requests(self) -> None:
        await self._hook("abort_all_requests")

    async def release_kv_cache(self) -> None:
        await self._hook("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._hook("resume_kv_cache")

    async def resume_generation(self) -> None:
        await self._hook("resume_generation")

    def shutdown(self) -> None:
        """Close every worker's engine, then end the actors."""
        _close_then_kill([worker.handle for worker in self._workers])
