"""``VllmRolloutReplica``: one vLLM ``AsyncLLM`` engine in a Ray actor, as a weightsync ``RolloutReplica``.

The actor (:class:`~weightsync.vllm.actor.VllmEngineActor`) owns the engine; vLLM runs its model in a worker
process of its own, where :class:`~weightsync.vllm.engine.WeightsyncTransferEngine` receives. The driver-side
handles forward the manager's calls to the actor, which turns them into vLLM calls:

========================  ==========================================================================================
manager                   vLLM
========================  ==========================================================================================
pause                     ``pause_generation(mode="keep", clear_cache=False)`` less its closing sleep
                          (``weightsync.vllm.internals.pause_keeping``): running requests and their KV cache stay;
                          they continue after the resume
``prepare``               ``collective_rpc("weightsync_prepare")`` (the worker extension; returns the metadata)
``init_process_group``    ``init_weight_transfer_engine`` with ``WeightsyncInitInfo``
update                    ``collective_rpc("weightsync_update")``: vLLM's worker steps ``start_weight_update`` →
                          ``update_weights({"version": v})`` → ``finish_weight_update`` in one call, which returns
                          the report and the proof of load (or the typed error) as plain data
resume                    ``update_weight_version(str(v))`` for a committed update, then ``resume_generation()``
``ping``                  answered by the actor itself: a ``collective_rpc`` would queue behind the transfer
``stage_weights``         a staged update's stage (``SyncConfig.staged``): run by the actor itself, never by vLLM
``apply_staged``          ``collective_rpc("weightsync_update")`` with the staged update in ``update_info``
========================  ==========================================================================================

A staged update never stops generation to stage: vLLM runs ``collective_rpc`` on its engine core's loop, so a
receive inside an RPC would. Instead the actor holds an ``EngineHost`` of its own (its *stager* engine, built at
``prepare`` when the spec says ``staged``): that engine is the one the actor's ``prepare`` answers with for worker 0
and joins the transport's world in worker 0's place, while vLLM's worker engines join the epoch idle.
``stage_weights`` receives the update into the host's staging area in the actor's process, on threads of its own,
as requests keep being served; the swap is one RPC whose stream every vLLM worker reads from that area.

A replica whose update failed after vLLM had started loading is torn: the manager keeps it paused, and the actor
aborts the requests it kept, each ending with ``ReplicaTornError`` (never left waiting), and refuses new ones until
an update repairs it.

**Several workers** (``tensor_parallel_size`` > 1): every vLLM worker is a rollout worker of the replica (the
manager's ``worker0``, ``worker1``, …; each declares the part of the checkpoint its loaders keep,
``weightsync.vllm.parts``), while vLLM runs each step on all its workers in one ``collective_rpc``. The manager
calls each worker; the actor meets the calls of one step (``weightsync.vllm.actor.Rendezvous``) and makes the one
RPC, with every worker's arguments in it (each vLLM worker takes its own entry), and hands each caller its own
result. The proof of load keys each worker's sums by its place (``worker1/model.layers.0...``).

What the last update or reload went without, where the installed vLLM lacks an internal the adapter uses (a
fallback taken, a check skipped: ``weightsync.vllm.internals``), the replica reports in
:meth:`VllmRolloutReplica.notes`; :meth:`VllmEngineActor.internals` says which internals its processes use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from weightsync.api.errors import ConfigError
from weightsync.api.hooks import WholePauseHooks
from weightsync.api.types import StagedUpdate
from weightsync.ray.group import RayStagingWorker, actor_options, worker_answer
from weightsync.vllm.actor import EXTENSION, VllmEngineActor

__all__ = ["VllmEngineActor", "VllmRolloutReplica", "VllmWorker", "engine_args"]


def engine_args(model: str, **overrides: Any) -> dict[str, Any]:
    """``AsyncEngineArgs`` keywords for a small CPU replica of ``model`` (a checkpoint directory); ``overrides`` win.

    Tokenizer off (requests are token ids), bf16, eager, a 64 MiB KV cache."""
    args: dict[str, Any] = {
        "model": model, "skip_tokenizer_init": True, "dtype": "bfloat16", "enforce_eager": True,
        "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512, "max_num_seqs": 16,
        "distributed_executor_backend": "mp",
    }
    args.update(overrides)
    return args


class VllmWorker(RayStagingWorker):
    """One of a replica's vLLM workers, as the manager sees it: its calls go to the replica's actor with its place
    (``index``), where the calls of every worker of a step meet (:class:`weightsync.vllm.actor.Rendezvous`)."""

    def __init__(self, handle: Any, *, name: str, index: int) -> None:
        super().__init__(handle, name=name)
        self.index = index

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return worker_answer(self.handle.execute_checkpoint_engine.remote(method, worker=self.index, **kwargs),
                             self.name)

    def update_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.update_weights.remote(version=version, worker=self.index), self.name)

    def stage_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.stage_weights.remote(version=version, worker=self.index), self.name)

    def apply_staged(self, *, version: int, staged: StagedUpdate) -> Any:
        return worker_answer(self.handle.apply_staged.remote(version=version, staged=staged, worker=self.index),
                             self.name)

    def execute_as_peer(self, method: str, /, **kwargs: Any) -> Any:
        """``PeerWorker``: this (one-worker) replica serves one that joins (``weightsync.vllm.peer``)."""
        return worker_answer(self.handle.execute_as_peer.remote(method, worker=self.index, **kwargs), self.name)

    def serve_weights(self, *, version: int) -> Any:
        return worker_answer(self.handle.serve_weights.remote(version=version, worker=self.index), self.name)


class VllmRolloutReplica(WholePauseHooks):
    """``RolloutReplica`` (and ``PausableReplica``) for one vLLM engine in a Ray actor.

    ``release_kv_cache``/``resume_kv_cache`` do nothing on purpose: the pause keeps requests and their KV cache.
    ``weight_checksums`` is what the manager compares across replicas after an update (the proof of load): a fast
    hash (XXH3-128) of every parameter vLLM holds, computed in vLLM's worker while the replica is paused;
    ``vllm_checksums`` is vLLM's own ``compute_weight_checksums`` (SHA-256), which the tests compare with a
    reference engine's.
    """

    def __init__(self, handle: Any, *, name: str, workers: int = 1) -> None:
        self.handle = handle
        self.name = name
        # The actor answers a RolloutWorker's calls (and a StagingWorker's) itself, for each of vLLM's workers.
        self._workers = [VllmWorker(handle, name=f"worker{index}", index=index) for index in range(workers)]

    @classmethod
    async def create(cls, *, replica: int, args: Mapping[str, Any], weightsync: bool = True,
                     env: Mapping[str, str] | None = None, node_id: str | None = None,
                     ray_options: Mapping[str, Any] | None = None, parts: bool = True) -> VllmRolloutReplica:
        """Start the actor and its engine (``args``: ``AsyncEngineArgs`` keywords, see :func:`engine_args`). With
        ``tensor_parallel_size`` > 1 the replica has that many workers (the module docstring), each receiving only
        its part; ``parts=False``: each receives the whole model (vLLM's loaders take their slices, as from a
        checkpoint), for a model whose part should not be trusted and for comparisons."""
        workers = args.get("tensor_parallel_size", 1)
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive int, got {workers!r}")
        if not isinstance(parts, bool):
            raise ConfigError(f"parts must be a bool, got {parts!r}")
        if int(args.get("pipeline_parallel_size", 1)) != 1:
            raise ConfigError("VllmRolloutReplica does not run pipeline_parallel_size > 1: the installed CPU build of "
                              "vLLM starts such an engine but fails at its first generate (an AssertionError in its "
                              "pipeline-parallel scheduling); use tensor_parallel_size")
        name = f"replica{replica}"
        handle = ray.remote(VllmEngineActor).options(**actor_options(ray_options, node_id)).remote(
            name=name, args=args, weightsync=weightsync, env=env, parts=parts)
        made = cls(handle, name=name, workers=workers)
        try:
            await handle.start.remote()
        except BaseException:
            ray.kill(handle)
            raise
        return made

    @property
    def workers(self) -> list[RayStagingWorker]:
        return list(self._workers)

    async def pause(self) -> None:
        await self.handle.pause.remote()

    async def resume(self) -> None:
        await self.handle.resume.remote()

    async def weight_checksums(self) -> dict[str, str]:
        """What the manager compares across replicas after an update: a fast hash of every parameter vLLM holds
        (``VllmEngineActor.load_checksums``); vLLM's own SHA-256 checksums are :meth:`vllm_checksums`."""
        return dict(await self.handle.load_checksums.remote())

    async def notes(self) -> list[str]:
        """What the last update or reload went without (:meth:`VllmEngineActor.notes`): a fallback the installed
        vLLM made the replica take, a check it skipped; empty when nothing."""
        return list(await self.handle.notes.remote())

    async def vllm_checksums(self) -> dict[str, str]:
        """vLLM's ``compute_weight_checksums`` (SHA-256 of every parameter)."""
        return dict(await self.handle.checksums.remote())

    async def torn(self, reason: str) -> None:
        await self.handle.tear.remote(reason)

    def generate(self, prompt_token_ids: Sequence[int], **kwargs: Any) -> Any:
        """An ObjectRef of :meth:`VllmEngineActor.generate`'s result."""
        return self.handle.generate.remote(list(prompt_token_ids), **kwargs)

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """An ObjectRef of the actor's ``method`` (``reload``, ``parameters``, ``is_paused``, ...)."""
        return getattr(self.handle, method).remote(*args, **kwargs)

    async def stop(self) -> None:
        """Close weightsync's engine and vLLM's, then end the actor."""
        try:
            await asyncio.wait_for(self.handle.stop.remote(), 60)
        finally:
            ray.kill(self.handle)
