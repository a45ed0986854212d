"""``VllmEngineActor``: the Ray actor that owns one vLLM ``AsyncLLM`` engine and answers weightsync's calls for
each of its vLLM workers (``weightsync.vllm.replica`` has the driver's side and the mapping onto vLLM's calls).

With several vLLM workers (``tensor_parallel_size`` > 1) the manager calls each of them, while vLLM runs a step on
all of them in one ``collective_rpc``: the calls of one step meet here (:class:`Rendezvous`), the last to arrive
makes the one RPC with every worker's arguments (each vLLM worker takes its own entry), and each caller gets its
own result.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ray

from weightsync.api.errors import ConfigError, LifecycleError, ReplicaTornError, WorkerDiedError
from weightsync.api.parts import PART_KEY, Part
from weightsync.api.types import StagedUpdate, TransferReport
from weightsync.api.topology import epoch_of
from weightsync.core.transports.place import LOCAL_RANK_ENV, ping_answer
from weightsync.core.transports.plan import Idle, encode_plan
from weightsync.core.worker.host import EngineHost, check_planned_part, is_untouched
from weightsync.vllm import internals, peer
from weightsync.vllm.engine import BACKEND, error_from_data

__all__ = ["EXTENSION", "Rendezvous", "VllmEngineActor", "idle_keeping_part"]

EXTENSION = "weightsync.vllm.extension.WeightsyncWorkerExtension"


class Rendezvous:
    """Where the calls of one step from a replica's workers meet, in its actor: the last to arrive runs the step for
    all of them (``run``, given every worker's value in worker order) and each caller gets its own entry of the
    result (an exception entry is raised to its worker alone). A worker that calls again before the others arrived
    (its step was retried) starts the step anew: the earlier callers get a ``LifecycleError``. A replica's steps
    come one after another, so a call of another step means the manager gave up on an unfinished one (a worker of it
    timed out or failed): its callers get a ``LifecycleError`` too, and nothing of it is kept."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._open: dict[str, tuple[dict[int, Any], asyncio.Future[list[Any]]]] = {}

    async def join(self, step: str, worker: int, value: Any, run: Callable[[list[Any]], Awaitable[list[Any]]]) -> Any:
        if not 0 <= worker < self.size:
            raise ConfigError(f"worker {worker} of a replica of {self.size} workers")
        for other in [key for key in self._open if key != step]:
            _end(self._open.pop(other)[1], LifecycleError(f"{other}: given up: {step} began before every worker "
                                                          f"had called {other}"))
        values, future = self._open.get(step) or ({}, asyncio.get_running_loop().create_future())
        if worker in values:  # a retried step: the earlier round is over
            _end(future, LifecycleError(f"{step}: worker {worker} called again before every worker had"))
            values, future = {}, asyncio.get_running_loop().create_future()
        values[worker] = value
        self._open[step] = (values, future)
        if len(values) == self.size:
            del self._open[step]
            try:
                future.set_result(await run([values[index] for index in range(self.size)]))
            except BaseException as exc:  # noqa: BLE001 - every caller raises it
                future.set_exception(exc)
        result = (await asyncio.shield(future))[worker]
        if isinstance(result, BaseException):
            raise result
        return result


def _end(future: asyncio.Future[list[Any]], error: LifecycleError) -> None:
    """End an unfinished step's round: its callers raise ``error``."""
    future.set_exception(error)
    future.exception()  # retrieved here: its callers raise it


class VllmEngineActor:
    """Body of the Ray actor that owns one ``AsyncLLM`` engine.

    ``weightsync=True`` starts it with weightsync as its weight-transfer engine; ``False`` gives a plain engine (a
    reference that loads versions from checkpoints with :meth:`reload`). ``env`` is set before vLLM is imported
    (e.g. ``VLLM_CPU_OMP_THREADS_BIND``). ``parts=False``: each of several vLLM workers receives the whole model
    instead of declaring its part.
    """

    def __init__(self, *, name: str, args: Mapping[str, Any], weightsync: bool = True,
                 env: Mapping[str, str] | None = None, parts: bool = True) -> None:
        os.environ.update(env or {})
        self.name = name
        self._args = dict(args)
        self._weightsync = weightsync
        self._declare_parts = parts
        self._llm: Any = None
        self.workers = int(args.get("tensor_parallel_size", 1))
        self._meet = Rendezvous(self.workers)
        self._local_ranks: list[int] = []
        """vLLM's local rank of each of its workers (which picks each one's rail), asked at start."""
        self._specs: list[dict[str, Any]] | None = None
        self._parts: list[Part | None] = [None] * self.workers
        """What each vLLM worker declared it holds, at the last prepare."""
        self._part_notes: list[str] = []
        """The tensors a worker's part keeps whole where its loaders could not be recorded (``notes``)."""
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
        if self._weightsync:
            # Each vLLM worker's rail follows vLLM's local rank (it sets its own at prepare); this actor answers
            # pings for them, and its stager (staged updates) takes worker 0's place.
            self._local_ranks = [int(rank) for rank in await self._rpc("weightsync_local_rank")]
            os.environ[LOCAL_RANK_ENV] = str(self._local_ranks[0])

    def _engine(self) -> Any:
        """The running engine; a ``WorkerDiedError`` once vLLM says it is dead (``AsyncLLM.errored``: its engine
        core process is gone), though this actor lives: the replica is as dead as if it were not."""
        if self._llm is None:
            raise LifecycleError(f"{self.name}: the vLLM engine is not started")
        if self._llm.errored:
            raise WorkerDiedError(f"{self.name}: the vLLM engine is dead (EngineDeadError)", worker=self.name,
                                  step="")
        return self._llm

    async def _rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """``method`` on every vLLM worker of the engine, in one ``collective_rpc``: each worker's result."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            results = list(await self._engine().collective_rpc(method, kwargs=kwargs))
        except EngineDeadError as exc:
            raise WorkerDiedError(f"{self.name}: the vLLM engine died during {method}", worker=self.name,
                                  step="") from exc
        if len(results) != self.workers:
            raise LifecycleError(f"{self.name}: {len(results)} vLLM workers answered, {self.workers} expected")
        return results

    def _keyed(self, per_worker: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """Every worker's mapping in one, each key prefixed with its worker where there are several."""
        if self.workers == 1:
            return dict(per_worker[0])
        return {f"worker{index}/{key}": value for index, entries in enumerate(per_worker)
                for key, value in entries.items()}

    # -- weightsync's calls ----------------------------------------------------------------------------------------

    async def execute_checkpoint_engine(self, method: str, /, worker: int = 0, **kwargs: Any) -> Any:
        if method == "ping":
            if self._llm is not None:
                self._engine()  # a dead engine answers as a dead worker
            answer = functools.partial(ping_answer, node_id=self._node_id, host_ip=self._host_ip,
                                       probe=list(kwargs.get("probe", ())),
                                       local_rank=self._local_ranks[worker] if worker < len(self._local_ranks) else None)
            # Probes of addresses may wait a second each: off the actor's loop, which serves requests.
            return await asyncio.to_thread(answer) if kwargs.get("probe") else answer()
        if method == "prepare":
            return await self._meet.join("prepare", worker, dict(kwargs["engine"]), self._prepare)
        if method == "init_process_group":
            return await self._meet.join("init", worker, dict(kwargs["rank_args"]), self._init)
        if method in ("finalize", "close"):
            return await self._meet.join(method, worker, None, lambda _: self._finish(method))
        raise ConfigError(f"unknown checkpoint-engine method {method!r}")

    async def _prepare(self, specs: list[dict[str, Any]]) -> list[Any]:
        self._specs = specs
        metadata = await self._rpc("weightsync_prepare", engine=specs, node_id=self._node_id, host_ip=self._host_ip,
                                   parts=self._declare_parts)
        self._parts = [Part.from_dict(entry[PART_KEY]) if PART_KEY in entry else None for entry in metadata]
        self._part_notes = [f"worker{index} receives {', '.join(part.fallbacks)} whole: its loaders compute on them "
                            "or take what is not a box" for index, part in enumerate(self._parts)
                            if part is not None and part.fallbacks]
        if not specs[0].get("config", {}).get("staged"):
            await self._drop_stager()
            return metadata
        if self._stager is None:
            self._stager = EngineHost(node_id=self._node_id, host_ip=self._host_ip, name=f"{self.name}'s stager")
        # Worker 0's place in the world is the stager's (it may stage for the host); its part stays its own.
        self._stager.part = self._parts[0]
        metadata[0] = await self._stager.execute("prepare", engine=specs[0])
        return metadata

    async def _init(self, rank_args: list[dict[str, Any]]) -> list[Any]:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        epoch = epoch_of(rank_args[0])
        for index, (args, part) in enumerate(zip(rank_args, self._parts)):  # before anything connects
            check_planned_part(args, part, who=f"{self.name}/worker{index}")
        if self._stager is not None:  # it takes worker 0's place in the world; vLLM's worker 0 reads staging
            await self._stager.execute("init_process_group", rank_args=rank_args[0])
            rank_args = [idle_keeping_part(rank_args[0], epoch), *rank_args[1:]]
        await self._engine().init_weight_transfer_engine(WeightTransferInitRequest(init_info={
            "engine": self._specs, "rank_args": rank_args, "epoch": epoch,
        }))
        return [None] * self.workers

    async def _finish(self, method: str) -> list[Any]:
        if method == "close":
            await self._drop_stager()
        elif self._stager is not None:
            await self._stager.execute("finalize")
        return await self._rpc(f"weightsync_{method}")

    def set_copy(self, mode: str) -> None:
        """How tensors are handed to vLLM's loader from the next update on (``WeightsyncUpdateInfo.copy``: "held",
        the default; "all"; "none", wrong, for the test that shows it is)."""
        from weightsync.vllm.engine import COPY_MODES

        if mode not in COPY_MODES:
            raise ConfigError(f"copy must be one of {COPY_MODES}, not {mode!r}")
        self._copy = mode

    async def update_weights(self, *, version: int, worker: int = 0) -> TransferReport:
        update_info = {"version": version, "copy": self._copy}
        report: TransferReport = await self._meet.join(f"update {version}", worker, None,
                                                       lambda _: self._update(update_info))
        return report

    async def execute_as_peer(self, method: str, /, worker: int = 0, **kwargs: Any) -> Any:
        """``PeerWorker``: a step of the engine a one-worker replica serves a joining one with (``peer``)."""
        if method == "ping":
            return await self.execute_checkpoint_engine(method, worker, **kwargs)
        stager = peer.serving_stager(self._stager, self._specs)
        if stager is not None:
            return await stager.execute_as_peer(method, **kwargs)
        return (await self._rpc("weightsync_peer", step=method, kwargs=kwargs))[0]

    async def serve_weights(self, *, version: int, worker: int = 0) -> TransferReport:
        stager = peer.serving_stager(self._stager, self._specs)
        return await (stager.serve(version=version) if stager is not None else
                      peer.serve_from(self._rpc, version, name=self.name))

    async def stage_weights(self, *, version: int, worker: int = 0) -> StagedUpdate:
        """A staged update's stage, in this actor (module docstring): vLLM keeps serving. Only worker 0 stages (its
        place in the world is the stager's)."""
        if self._stager is None or worker != 0:
            raise LifecycleError(f"{self.name}: stage_weights on worker {worker} without a staged prepare "
                                 "(SyncConfig.staged; worker 0 stages)")
        return await self._stager.stage(version=version)

    async def apply_staged(self, *, version: int, staged: StagedUpdate, worker: int = 0) -> TransferReport:
        """A staged update's swap: vLLM's workers load what this host staged, as an update's stream."""
        update_info = {"version": version, "copy": self._copy, "staged": staged.to_dict()}
        report: TransferReport = await self._meet.join(f"apply {version}", worker, None,
                                                       lambda _: self._update(update_info))
        return report

    async def _update(self, update_info: dict[str, Any]) -> list[TransferReport | BaseException]:
        """One update on every vLLM worker, in one RPC: each worker's report, or its error (a torn replica when any
        worker's model may have been written)."""
        self._verified = None
        self._timings = {}
        self._load_sums = None
        self._notes = []
        try:
            outcomes = await self._rpc("weightsync_update", update_info=update_info)
        except Exception as exc:  # raised by vLLM itself (its RPC carries only the message)
            error = LifecycleError(f"{self.name}: vLLM's weight update failed: {exc}")
            await self.tear(f"LifecycleError: {error}")
            return [error] * self.workers
        self._notes = sorted({*internals.notes("pause_scheduler"),
                              *(note for outcome in outcomes for note in outcome.get("notes", ()))})
        results: list[TransferReport | BaseException] = [
            error_from_data(outcome["error"], where=f"{self.name}/worker{index}") if "error" in outcome
            else TransferReport.from_dict(outcome["report"]) for index, outcome in enumerate(outcomes)]
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            touched = [error for error in failed if not is_untouched(error)]
            if touched:
                await self.tear(f"{type(touched[0]).__name__}: {touched[0]}")
            return results
        self._timings["load_seconds"] = max(float(outcome.get("load_seconds", 0.0)) for outcome in outcomes)
        self._timings.update({f"stream_cpu_seconds.worker{index}": float(outcome.get("stream_cpu_seconds", 0.0))
                              for index, outcome in enumerate(outcomes)})
        self._load_sums = self._keyed([outcome.get("load_checksums") or {} for outcome in outcomes])
        self._verified = int(update_info["version"])
        return results

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
        internal the installed vLLM lacks, naming its version, the fallback taken or the check skipped; and the
        tensors a worker receives whole because its loaders could not be recorded as regions
        (``weightsync.vllm.parts``); empty when it went without nothing."""
        return [*self._part_notes, *self._notes]

    async def internals(self, avoid: list[str] | None = None) -> dict[str, dict[str, str]]:
        """``weightsync.vllm.internals.report()`` of this actor's process (``"actor"``) and of each of vLLM's
        workers (``"worker0"``, ``"worker1"``, ...), after ``internals.avoid(avoid)`` in all of them when given
        (``[]``: every internal the probe found is used again)."""
        if avoid is not None:
            internals.avoid(avoid)
        workers = await self._rpc("weightsync_internals", avoid=avoid)
        return {"actor": internals.report(), **{f"worker{index}": report for index, report in enumerate(workers)}}

    def timings(self) -> dict[str, float]:
        """Measured here and in vLLM's worker for the last update or reload: ``pause_seconds`` (from the pause to
        the end of the resume), ``load_seconds`` (vLLM's own load, see ``LoadClock``; the slowest worker's), for an
        update ``stream_cpu_seconds.worker<i>`` (each worker's CPU time on weightsync's side of it: taking each
        bucket, handing vLLM its views, hashing what the worker verifies), and for a reload ``read_seconds`` (reading
        the checkpoint)."""
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
        """vLLM's SHA-256 of every parameter it holds (``AsyncLLM.compute_weight_checksums``), keyed by worker
        where there are several."""
        return self._keyed(list(await self._engine().compute_weight_checksums()))

    async def load_checksums(self) -> dict[str, str]:
        """weightsync's proof of load: XXH3-128 of every parameter vLLM holds (``parameter_checksums``). Right after
        an update, the sums vLLM's worker took as the load finished (nothing ran on the model since: it is
        paused); asked again, or after anything else, taken anew."""
        sums, self._load_sums = self._load_sums, None
        if sums is None:
            sums = self._keyed(await self._rpc("weightsync_checksums"))
        return dict(sums)

    async def parameters(self) -> dict[str, list[int]]:
        """The shape of every parameter vLLM holds, keyed by worker where there are several."""
        return self._keyed(await self._rpc("weightsync_parameters"))

    async def reload(self, path: str) -> dict[str, float]:
        """Load a checkpoint directory with vLLM's own ``reload_weights`` (a reference engine, or the disk route);
        its timings (``WeightsyncWorkerExtension.weightsync_reload``)."""
        self._load_sums = None
        self._notes = []
        every = [dict(timings) for timings in await self._rpc("weightsync_reload", weights_path=path)]
        self._notes = sorted({note for timings in every for note in timings.pop("notes")})
        timings = {key: max(float(entry[key]) for entry in every) for key in every[0]}
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
        if self._weightsync and self._specs is not None:
            try:
                await self._drop_stager()
                await asyncio.wait_for(llm.collective_rpc("weightsync_close"), 30)
            except Exception:  # noqa: BLE001 - shutting down: the engine's own shutdown still runs
                pass
        llm.shutdown()


def idle_keeping_part(rank_args: Mapping[str, Any], epoch: str) -> dict[str, Any]:
    """An idle plan for ``epoch`` that keeps ``rank_args``' part (a worker that reads the host's staging area
    verifies its part of what it reads)."""
    idle = encode_plan(Idle(epoch=epoch))
    if "part" in rank_args:
        idle["part"] = rank_args["part"]
    return idle
