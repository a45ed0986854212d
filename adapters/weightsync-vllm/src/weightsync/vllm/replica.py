"""``VllmRolloutReplica``: one vLLM ``AsyncLLM`` engine in a Ray actor, as a weightsync ``RolloutReplica``.

The actor (:class:`VllmEngineActor`) owns the engine; vLLM runs its model in a worker process of its own, where
:class:`~weightsync.vllm.engine.WeightsyncTransferEngine` receives. The driver-side handles forward the manager's
calls to the actor, which turns them into vLLM calls:

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
``prepare`` when the spec says ``staged``): that engine is the one the actor's ``prepare`` answers with and joins
the transport's world, while vLLM's worker engine joins the epoch idle. ``stage_weights`` receives the update into
the host's staging area in the actor's process, on threads of its own, as requests keep being served; the swap is
one RPC whose stream the worker reads from that area.

A replica whose update failed after vLLM had started loading is torn: the manager keeps it paused, and the actor
aborts the requests it kept, each ending with ``ReplicaTornError`` (never left waiting), and refuses new ones until
an update repairs it. One worker per replica: tensor parallelism inside one vLLM engine (several workers behind one
``collective_rpc``) is not supported yet, and ``create`` refuses it.

What the last update or reload went without, where the installed vLLM lacks an internal the adapter uses (a
fallback taken, a check skipped: ``weightsync.vllm.internals``), the replica reports in
:meth:`VllmRolloutReplica.notes`; :meth:`VllmEngineActor.internals` says which internals its processes use.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from weightsync.api.errors import ConfigError, LifecycleError, ReplicaTornError
from weightsync.api.hooks import WholePauseHooks
from weightsync.api.types import StagedUpdate, TransferReport
from weightsync.api.topology import epoch_of
from weightsync.core.transports.place import ping_answer
from weightsync.core.transports.plan import Idle, encode_plan
from weightsync.core.worker.host import EngineHost, is_untouched
from weightsync.ray.group import RayStagingWorker, actor_options
from weightsync.vllm import internals
from weightsync.vllm.engine import BACKEND, error_from_data

__all__ = ["VllmEngineActor", "VllmRolloutReplica", "engine_args"]

EXTENSION = "weightsync.vllm.extension.WeightsyncWorkerExtension"


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


class VllmEngineActor:
    """Body of the Ray actor that owns one ``AsyncLLM`` engine.

    ``weightsync=True`` starts it with weightsync as its weight-transfer engine; ``False`` gives a plain engine (a
    reference that loads versions from checkpoints with :meth:`reload`). ``env`` is set before vLLM is imported
    (e.g. ``VLLM_CPU_OMP_THREADS_BIND``).
    """

    def __init__(self, *, name: str, args: Mapping[str, Any], weightsync: bool = True,
                 env: Mapping[str, str] | None = None) -> None:
        os.environ.update(env or {})
        self.name = name
        self._args = dict(args)
        self._weightsync = weightsync
        self._llm: Any = None
        self._spec: dict[str, Any] | None = None
        self._verified: int | None = None  # the version the last update delivered and verified (set on resume)
        self._torn: str | None = None
        self._requests: set[str] = set()
        self._copy = "held"
        self._paused_at: float | None = None
        self._pauses: list[list[float]] = []  # [paused, resumed] in wall-clock seconds, resumed 0.0 while paused
        self._timings: dict[str, float] = {}
        self._load_sums: dict[str, str] | None = None  # the proof of load the last update took, until it is read
        self._notes: list[str] = []  # what the last update or reload went without (VllmRolloutReplica.notes)
        self._stager: EngineHost | None = None  # staged updates only: the engine that stages (module docstring)
        context = ray.get_runtime_context()
        self._node_id = context.get_node_id()
        self._host_ip = ray.util.get_node_ip_address()

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(self._args, worker_extension_cls=EXTENSION)
        if self._weightsync:
            args.update(weight_transfer_config={"backend": BACKEND})
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def _engine(self) -> Any:
        if self._llm is None:
            raise LifecycleError(f"{self.name}: the vLLM engine is not started")
        return self._llm

    async def _rpc(self, method: str, **kwargs: Any) -> Any:
        results = await self._engine().collective_rpc(method, kwargs=kwargs)
        if len(results) != 1:
            raise ConfigError(f"{self.name}: {len(results)} vLLM workers answered; one worker per replica for now")
        return results[0]

    # -- weightsync's calls ----------------------------------------------------------------------------------------

    async def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        if method == "ping":
            return ping_answer(node_id=self._node_id, host_ip=self._host_ip)
        if method == "prepare":
            self._spec = dict(kwargs["engine"])
            metadata = await self._rpc("weightsync_prepare", engine=self._spec, node_id=self._node_id,
                                       host_ip=self._host_ip)
            if not self._spec.get("config", {}).get("staged"):
                await self._drop_stager()
                return metadata
            if self._stager is None:
                self._stager = EngineHost(node_id=self._node_id, host_ip=self._host_ip, name=f"{self.name}'s stager")
            return await self._stager.execute("prepare", engine=self._spec)
        if method == "init_process_group":
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            rank_args = dict(kwargs["rank_args"])
            epoch = epoch_of(rank_args)
            if self._stager is not None:  # it takes this rank's place in the world; vLLM's engine reads staging
                await self._stager.execute("init_process_group", rank_args=rank_args)
                rank_args = encode_plan(Idle(epoch=epoch))
            await self._engine().init_weight_transfer_engine(WeightTransferInitRequest(init_info={
                "engine": self._spec, "rank_args": rank_args, "epoch": epoch,
            }))
            return None
        if method == "close":
            await self._drop_stager()
        elif method == "finalize" and self._stager is not None:
            await self._stager.execute("finalize")
        if method in ("finalize", "close"):
            return await self._rpc(f"weightsync_{method}")
        raise ConfigError(f"unknown checkpoint-engine method {method!r}")

    def set_copy(self, mode: str) -> None:
        """How tensors are handed to vLLM's loader from the next update on (``WeightsyncUpdateInfo.copy``: "held",
        the default; "all"; "none", wrong, for the test that shows it is)."""
        from weightsync.vllm.engine import COPY_MODES

        if mode not in COPY_MODES:
            raise ConfigError(f"copy must be one of {COPY_MODES}, not {mode!r}")
        self._copy = mode

    async def update_weights(self, *, version: int) -> TransferReport:
        return await self._update({"version": version, "copy": self._copy})

    async def stage_weights(self, *, version: int) -> StagedUpdate:
        """A staged update's stage, in this actor (module docstring): vLLM keeps serving."""
        if self._stager is None:
            raise LifecycleError(f"{self.name}: stage_weights without a staged prepare (SyncConfig.staged)")
        return await self._stager.stage(version=version)

    async def apply_staged(self, *, version: int, staged: StagedUpdate) -> TransferReport:
        """A staged update's swap: vLLM's worker loads what this host staged, as an update's stream."""
        return await self._update({"version": version, "copy": self._copy, "staged": staged.to_dict()})

    async def _update(self, update_info: dict[str, Any]) -> TransferReport:
        self._verified = None
        self._timings = {}
        self._load_sums = None
        self._notes = []
        try:
            try:
                outcome = await self._rpc("weightsync_update", update_info=update_info)
            except Exception as exc:  # raised by vLLM itself (its RPC carries only the message)
                raise LifecycleError(f"{self.name}: vLLM's weight update failed: {exc}") from exc
            self._notes = [*internals.notes("pause_scheduler"), *outcome.get("notes", ())]
            if "error" in outcome:
                raise error_from_data(outcome["error"], where=self.name)
            report = TransferReport.from_dict(outcome["report"])
            self._timings["load_seconds"] = float(outcome.get("load_seconds", 0.0))
            self._load_sums = outcome.get("load_checksums")
        except BaseException as exc:
            if not is_untouched(exc):
                await self.tear(f"{type(exc).__name__}: {exc}")
            raise
        self._verified = int(update_info["version"])
        return report

    async def _drop_stager(self) -> None:
        stager, self._stager = self._stager, None
        if stager is not None:
            await stager.execute("close")

    async def tear(self, reason: str) -> None:
        """The model is half-loaded: end every kept request (each raises ``ReplicaTornError``), refuse new ones."""
        self._torn = reason
        self._load_sums = None
        if self._requests:
            await self._engine().abort(list(self._requests))

    async def pause(self) -> None:
        self._paused_at = time.perf_counter()
        self._pauses.append([time.time(), 0.0])
        await internals.pause_keeping(self._engine())

    async def resume(self) -> None:
        llm = self._engine()
        if self._verified is not None:
            await llm.update_weight_version(str(self._verified))
            self._verified = None
        self._torn = None
        await llm.resume_generation()
        if self._paused_at is not None:
            self._timings["pause_seconds"] = time.perf_counter() - self._paused_at
            self._paused_at = None
        if self._pauses and not self._pauses[-1][1]:
            self._pauses[-1][1] = time.time()

    def pause_log(self) -> list[list[float]]:
        """Every pause of this replica as ``[paused, resumed]`` (wall-clock seconds; ``resumed`` is 0.0 while it is
        still paused): the pauses as the actor saw them, whatever the manager reports."""
        return [list(entry) for entry in self._pauses]

    def notes(self) -> list[str]:
        """What the last update or reload went without (``weightsync.vllm.internals.notes``): one line per vLLM
        internal the installed vLLM lacks, naming its version, the fallback taken or the check skipped; empty when
        it went without nothing."""
        return list(self._notes)

    async def internals(self, avoid: list[str] | None = None) -> dict[str, dict[str, str]]:
        """``weightsync.vllm.internals.report()`` of this actor's process and of vLLM's worker, after
        ``internals.avoid(avoid)`` in both when given (``[]``: every internal the probe found is used again)."""
        if avoid is not None:
            internals.avoid(avoid)
        return {"actor": internals.report(), "worker": await self._rpc("weightsync_internals", avoid=avoid)}

    def timings(self) -> dict[str, float]:
        """Measured here and in vLLM's worker for the last update or reload: ``pause_seconds`` (from the pause to
        the end of the resume), ``load_seconds`` (vLLM's own load, see ``LoadClock``), and for a reload
        ``read_seconds`` (reading the checkpoint)."""
        return dict(self._timings)

    # -- serving and inspection ------------------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Sequence[int], *, max_tokens: int = 8, logprobs: int = 0,
                       request_id: str | None = None) -> dict[str, Any]:
        """Greedy generation; token ids, the top ``logprobs`` per step as ``[token, logprob]`` pairs (sorted by
        token), and the weight versions that produced them as ``[version, start, end]`` spans."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._torn is not None:
            raise ReplicaTornError(f"{self.name} is torn: {self._torn}", replica=self.name, reason=self._torn)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs or None,
                                detokenize=False, ignore_eos=True)
        request = request_id or uuid.uuid4().hex
        self._requests.add(request)
        final: Any = None
        try:
            async for output in self._engine().generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                                                        params, request_id=request):
                final = output
        finally:
            self._requests.discard(request)
        completion = final.outputs[0] if final is not None else None
        torn = self._torn_reason()  # it may have changed while the request ran
        if torn is not None and (completion is None or completion.finish_reason == "abort"):
            raise ReplicaTornError(f"{self.name} was torn while serving request {request}: {torn}",
                                   replica=self.name, reason=torn)
        if completion is None:
            raise LifecycleError(f"{self.name}: request {request} produced no output")
        return {
            "token_ids": list(completion.token_ids),
            "logprobs": [sorted([token, entry.logprob] for token, entry in step.items())
                         for step in (completion.logprobs or [])],
            "weight_versions": [[span.version, span.start, span.end]
                                for span in completion.weight_versions or []],
            "finish_reason": completion.finish_reason,
        }

    def _torn_reason(self) -> str | None:
        return self._torn

    async def checksums(self) -> dict[str, str]:
        """vLLM's SHA-256 of every parameter it holds (``AsyncLLM.compute_weight_checksums``), one worker's."""
        merged: dict[str, str] = {}
        for worker in await self._engine().compute_weight_checksums():
            merged.update(worker)
        return merged

    async def load_checksums(self) -> dict[str, str]:
        """weightsync's proof of load: XXH3-128 of every parameter vLLM holds (``parameter_checksums``). Right after
        an update, the sums vLLM's worker took as the load finished (nothing ran on the model since: it is
        paused); asked again, or after anything else, taken anew."""
        sums, self._load_sums = self._load_sums, None
        if sums is None:
            sums = await self._rpc("weightsync_checksums")
        return dict(sums)

    async def parameters(self) -> dict[str, list[int]]:
        return dict(await self._rpc("weightsync_parameters"))

    async def reload(self, path: str) -> dict[str, float]:
        """Load a checkpoint directory with vLLM's own ``reload_weights`` (a reference engine, or the disk route);
        its timings (``WeightsyncWorkerExtension.weightsync_reload``)."""
        self._load_sums = None
        self._notes = []
        timings = dict(await self._rpc("weightsync_reload", weights_path=path))
        self._notes = list(timings.pop("notes"))
        self._timings = {"read_seconds": timings["read_seconds"], "load_seconds": timings["load_seconds"]}
        return timings

    async def weight_version(self) -> str:
        return str(await self._engine().get_weight_version())

    async def is_paused(self) -> bool:
        return bool(await self._engine().is_paused())

    async def stop(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._weightsync and self._spec is not None:
            try:
                await self._drop_stager()
                await asyncio.wait_for(llm.collective_rpc("weightsync_close"), 30)
            except Exception:  # noqa: BLE001 - shutting down: the engine's own shutdown still runs
                pass
        llm.shutdown()


class VllmRolloutReplica(WholePauseHooks):
    """``RolloutReplica`` (and ``PausableReplica``) for one vLLM engine in a Ray actor.

    ``release_kv_cache``/``resume_kv_cache`` do nothing on purpose: the pause keeps requests and their KV cache.
    ``weight_checksums`` is what the manager compares across replicas after an update (the proof of load): a fast
    hash (XXH3-128) of every parameter vLLM holds, computed in vLLM's worker while the replica is paused;
    ``vllm_checksums`` is vLLM's own ``compute_weight_checksums`` (SHA-256), which the tests compare with a
    reference engine's.
    """

    def __init__(self, handle: Any, *, name: str) -> None:
        self.handle = handle
        self.name = name
        # The actor answers a RolloutWorker's calls (and a StagingWorker's) itself.
        self._workers = [RayStagingWorker(handle, name="worker0")]

    @classmethod
    async def create(cls, *, replica: int, args: Mapping[str, Any], weightsync: bool = True,
                     env: Mapping[str, str] | None = None, node_id: str | None = None,
                     ray_options: Mapping[str, Any] | None = None) -> VllmRolloutReplica:
        """Start the actor and its engine (``args``: ``AsyncEngineArgs`` keywords, see :func:`engine_args`)."""
        if int(args.get("tensor_parallel_size", 1)) != 1 or int(args.get("pipeline_parallel_size", 1)) != 1:
            raise ConfigError("VllmRolloutReplica runs one vLLM worker per replica (tensor_parallel_size=1, "
                              "pipeline_parallel_size=1) for now")
        name = f"replica{replica}"
        handle = ray.remote(VllmEngineActor).options(**actor_options(ray_options, node_id)).remote(
            name=name, args=args, weightsync=weightsync, env=env)
        made = cls(handle, name=name)
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
