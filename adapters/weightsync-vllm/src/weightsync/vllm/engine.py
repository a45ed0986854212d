"""``WeightsyncTransferEngine``: vLLM's weight-transfer engine ``"weightsync"``, one in every vLLM worker process.

vLLM builds it in each worker's ``load_model`` when the engine was started with
``weight_transfer_config={"backend": "weightsync"}``. It holds a weightsync ``EngineHost`` (the rollout side of any
weightsync backend) and loads what that host receives through vLLM's own checkpoint loader, in the layerwise reload
lifecycle, so vLLM's fusion (q/k/v, gate/up), tensor-parallel slicing, quantisation and CPU repacking apply exactly
as when vLLM reads a checkpoint.

How weightsync's lifecycle maps onto vLLM's:

- ``prepare``: ``WeightsyncWorkerExtension.weightsync_prepare`` (a worker method called by name through
  ``collective_rpc``; vLLM's own API has no step that returns data), which builds the host's engine and returns its
  metadata as plain data.
- ``init_process_group``: vLLM's ``init_weight_transfer_engine(init_info)`` with :class:`WeightsyncInitInfo`
  (the backend and configuration it was prepared with, its per-rank arguments from ``build_topology``, the epoch).
- an update: vLLM's ``start_weight_update`` → ``update_weights({"version": v})`` → ``finish_weight_update``. The
  stream is consumed in ``update_weights``; the layerwise reload is finalized in ``finish_weight_update``.
  ``VllmRolloutReplica`` runs the three worker steps in one RPC (``WeightsyncWorkerExtension.weightsync_update``);
  driving them one by one through ``AsyncLLM`` works the same.
- a staged update's swap (``SyncConfig.staged``): the same three steps, with ``update_info["staged"]`` the
  ``StagedUpdate`` the host's stager answered (``StagedUpdate.to_dict``); the stream is then read from the host's
  staging area instead of the transport, and everything after it is the same. The stage phase never reaches this
  engine: the replica's Ray actor stages (``weightsync.vllm.replica``), and this engine joins the epoch idle.

Three things differ from vLLM's own checkpoint-format engines, each to keep a replica from serving wrong weights:

1. **Reload starts at the first tensor, not in ``start_weight_update``.** ``initialize_layerwise_reload`` moves
   every layer to the meta device; an update that then fails before any byte arrives would leave the model there.
   Here the first tensor is awaited first, so an update that never delivered one leaves the model as it was (the
   manager's *untouched*, resumed on its old weights).
2. **vLLM never keeps a view past its life.** The layerwise loader holds what it is handed until its whole layer
   has arrived (q, k and v for ``qkv_proj``); weightsync's stream gives views into its receive buffers. The
   loader takes them a bucket at a time (``BatchedWeights.next_batch``: views valid until the next batch) and hands
   vLLM the views; when vLLM asks for the tensor after the batch, whatever the layerwise reload still holds of the
   batch's views is replaced by a copy (``weightsync.vllm.internals.copy_held``). Only the parts of a fused layer
   whose rest is in a later bucket are copied (a few MB of 259 at 16 MiB buckets), not every tensor — a fresh CPU
   allocation costs about five times a copy into memory already mapped, so the copies go into buffers kept from
   the last update. A stream without batches gives one tensor at a time (then the held parts of every fused layer
   are copied). A model whose own ``load_weights`` keeps tensors elsewhere needs ``copy="all"`` (every tensor
   copied before vLLM sees it; also what ``copy="held"`` falls back to where the installed vLLM's layerwise reload
   does not hold its arguments as ``weightsync.vllm.internals`` expects).
3. **A failed update is finalized here.** vLLM forgets the update when ``update_weights`` raises, so the engine
   runs ``finalize_layerwise_reload`` itself: layers that received nothing get their previous tensors back, the
   rest are what arrived (the manager marks the replica torn and keeps it paused). A full update that left a layer
   with no weights at all (a tensor the sender never sent) raises ``LoadVerificationError`` naming it (where the
   installed vLLM lets ``weightsync.vllm.internals.missing_layers`` see it: otherwise the check is skipped, and
   the outcome's ``notes`` say so).

Errors cross vLLM's RPC only as strings, so the outcome of the last call (its report, or its error as plain data,
and its ``notes``: what it went without, ``weightsync.vllm.internals.notes``) is kept and read back through
``weightsync_outcome``; the Ray replica rebuilds the typed error from it. Every vLLM internal the engine touches is
in ``weightsync.vllm.internals``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.api import errors
from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConfigError, LifecycleError, LoadVerificationError, WeightsyncError
from weightsync.api.parts import Part
from weightsync.api.protocols import next_batch
from weightsync.api.topology import epoch_of
from weightsync.api.types import StagedUpdate, WorkerMetadata
from weightsync.core.transports.place import LOCAL_RANK_ENV
from weightsync.core.worker.host import EngineHost, is_untouched, mark_untouched
from weightsync.vllm import internals
from weightsync.vllm.parts import Unrecordable, checkpoint_shapes, record_part
from weightsync.vllm.peer import PeerServing

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

__all__ = ["LoadClock", "WeightsyncInitInfo", "WeightsyncTransferEngine", "WeightsyncUpdateInfo", "engine_in_process",
           "error_from_data", "error_to_data", "parameter_checksums"]

log = logging.getLogger(__name__)

BACKEND = "weightsync"
COPY_MODES = ("held", "all", "none")
_T = TypeVar("_T")
_in_process: weakref.ref[WeightsyncTransferEngine] | None = None


def parameter_checksums(model: torch.nn.Module) -> dict[str, str]:
    """XXH3-128 of the bytes of every parameter ``model`` holds, by name: weightsync's proof of load. The same
    parameters as vLLM's ``compute_weight_checksums`` (SHA-256), an order of magnitude faster."""
    import xxhash

    from weightsync.core.wire.tensors import as_byte_view, memoryview_of

    return {name: xxhash.xxh3_128_hexdigest(memoryview_of(as_byte_view(parameter.detach().contiguous())))
            for name, parameter in model.named_parameters()}


class LoadClock:
    """vLLM's own time in one load: from the start of the reload to its end, less the time its loader spent waiting
    for the next tensor (weightsync receiving and copying it, or vLLM's checkpoint iterator reading it from disk)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.waited = 0.0

    def iterate(self, items: Iterable[_T]) -> Iterator[_T]:
        """``items``, counting the time each ``next`` takes as waiting."""
        iterator = iter(items)
        while True:
            began = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.waited += time.perf_counter() - began
            yield item

    def load_seconds(self) -> float:
        return time.perf_counter() - self.started - self.waited


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What ``init_weight_transfer_engine`` carries for a replica's weightsync rollout workers (plain data
    throughout). vLLM hands the same ``init_info`` to every worker of the engine: it lists every worker's entries,
    and each engine takes its own (:attr:`WeightsyncTransferEngine.index`, as vLLM indexes a list ``update_info``).

    ``engine``: the spec each worker was prepared with (``weightsync.core.worker.host.engine_spec``: backend name,
    ``SyncConfig`` as a dict, role, rank); ``rank_args``: each worker's entry of the topology; ``epoch``: the
    membership epoch's token, which must be the one in every ``rank_args``.
    """

    engine: list[dict[str, Any]] = field(default_factory=list)
    rank_args: list[dict[str, Any]] = field(default_factory=list)
    epoch: str = ""


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: ``version`` labels it (the manager's counter). ``copy``: ``"held"`` copies what vLLM's layerwise
    reload keeps of a view past its life (the module's point 2), ``"all"`` copies every tensor first, ``"none"``
    hands vLLM the stream's views as they are, which is wrong: it exists for the test that shows it is.
    ``staged``: a staged update's swap, where its host staged it (``StagedUpdate.to_dict``); None: received now."""

    version: int = 0
    copy: str = "held"
    staged: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.copy not in COPY_MODES:
            raise ConfigError(f"WeightsyncUpdateInfo.copy must be one of {COPY_MODES}, not {self.copy!r}")


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """The rollout side of weightsync inside one vLLM worker (see the module docstring)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._host: EngineHost | None = None
        self._reloading = False
        self._updating = False
        self._timeout = 600.0
        self.clock: LoadClock | None = None
        """Times the reload in progress (from its first tensor to its finalize): ``outcome["load_seconds"]``."""
        self.kept: dict[tuple[int, int, str], torch.Tensor] = {}
        """CPU buffers the copies of held views go into, reused from update to update (``internals.copy_held``)."""
        self.outcome: dict[str, Any] = {}
        """The last step's result as plain data: ``{"report": ...}`` or ``{"error": ...}``, ``"notes"``
        (``weightsync_outcome``), and for an update ``"stream_cpu_seconds"``: the CPU time of the thread that ran
        weightsync's side of it (taking each bucket, handing vLLM its views, hashing what this worker verifies;
        vLLM's loader runs in a thread of its own, timed by ``load_seconds``)."""
        self.reload_cpu = 0.0
        """The CPU seconds vLLM's ``initialize_layerwise_reload`` took in this update (on the stream's thread)."""
        self.serving = PeerServing()
        """This worker serving a replica that joins (``weightsync.vllm.peer``)."""
        self._part: Part | None = None
        self._part_recorded = False
        """Whether ``_part`` was recorded (at the first prepare that wanted it; None is a result too)."""
        global _in_process
        _in_process = weakref.ref(self)  # vLLM builds one per worker process; the worker extension finds it here

    # -- weightsync's steps (called through WeightsyncWorkerExtension and vLLM's own methods) ----------------------

    @property
    def index(self) -> int:
        """This worker's place among the engine's workers: its entry in a list ``init_info`` or ``update_info``."""
        parallel = self.parallel_config
        return int(parallel.data_parallel_index) * int(parallel.world_size) + int(parallel.rank)

    def prepare(self, *, engine: Sequence[Mapping[str, Any]], node_id: str, host_ip: str, parts: bool = True,
                local_rank: int | None = None) -> WorkerMetadata:
        """Build (or keep) this worker's ``EngineHost`` and prepare its engine from its entry of ``engine``; a worker
        of an engine of several declares its part (recorded once, ``weightsync.vllm.parts``) unless ``parts`` is
        False (then it receives the whole model, as at one worker). ``local_rank``: vLLM's for this worker, which
        picks its rail (``LOCAL_RANK``, as vLLM's own XPU worker sets it; vLLM's CPU and CUDA workers do not)."""
        if local_rank is not None:
            os.environ[LOCAL_RANK_ENV] = str(local_rank)
        if self._host is None or (self._host.node_id, self._host.host_ip) != (node_id, host_ip):
            if self._host is not None:
                self._host.execute_sync("close")
            self._host = EngineHost(node_id=node_id, host_ip=host_ip, name=f"vllm worker {self.index}")
        if parts and not self._part_recorded:
            self._part, self._part_recorded = self._record_part(), True
        self._host.part = self._part if parts else None
        metadata: WorkerMetadata = self._host.execute_sync("prepare", engine=engine[self.index])
        return metadata

    def _record_part(self) -> Part | None:
        """What this worker keeps of the checkpoint, when it keeps less than all of it (one of several workers);
        None: the whole model (one worker, or where the installed vLLM does not let the part be recorded, which the
        notes of ``weightsync_internals`` say)."""
        if int(self.parallel_config.world_size) == 1:
            return None
        try:
            with internals.loadable(self.model) as recording:
                part = record_part(self.model, checkpoint_shapes(self.model_config.model)) if recording else None
        except Unrecordable as exc:
            log.warning("weightsync.vllm: worker %d receives the whole model: its part cannot be recorded (%s)",
                        self.index, exc)
            return None
        return part if part is not None and (part.tensors or part.fallbacks) else None

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        host = self._require_host("init_weight_transfer_engine")
        if len(init_info.rank_args) <= self.index or len(init_info.engine) <= self.index:
            raise ConfigError(f"init_info lists {len(init_info.rank_args)} workers' rank_args; this is worker "
                              f"{self.index}")
        rank_args, spec = init_info.rank_args[self.index], init_info.engine[self.index]
        if not init_info.epoch or epoch_of(rank_args) != init_info.epoch:
            raise ConfigError(f"init_info's epoch {init_info.epoch!r} is not the one in its rank_args "
                              f"({epoch_of(rank_args)!r})")
        if host.spec != dict(spec):
            raise LifecycleError("init_weight_transfer_engine for another engine than the one prepared; prepare again")
        host.execute_sync("init_process_group", rank_args=rank_args)
        self._timeout = SyncConfig.from_dict(spec["config"]).timeouts.transfer

    def start_weight_update(self) -> None:
        self._require_host("start_weight_update")
        if self._updating:
            raise LifecycleError("start_weight_update while an update is in progress")
        self._updating = True  # the reload itself starts at the first tensor (module docstring, point 1)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default also synchronizes the accelerator; the loader's copies here are synchronous already.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        host = self._require_host("update_weights")
        self.outcome = {}
        if not self._updating:
            raise LifecycleError("update_weights without start_weight_update")
        loader = _Loader(self, copy=update_info.copy)
        cpu = time.thread_time()
        self.reload_cpu = 0.0
        try:
            if update_info.staged is None:
                report = asyncio.run(host.receive(loader, version=update_info.version))
            else:
                staged = StagedUpdate.from_dict(update_info.staged)
                if staged.version != update_info.version:
                    mismatch = ConfigError(f"the swap of version {update_info.version} was handed version "
                                           f"{staged.version}'s staging area")
                    mark_untouched(mismatch)
                    raise mismatch
                report = asyncio.run(host.apply_staged(loader, staged=staged))
        except BaseException as exc:
            self._updating = False
            self._abandon_reload()
            self.outcome = {"error": error_to_data(exc), "notes": loader.notes}
            raise
        self.outcome = {"report": report.to_dict(), "notes": loader.notes,
                        "stream_cpu_seconds": time.thread_time() - cpu - self.reload_cpu}

    def finish_weight_update(self) -> None:
        self._updating = False
        if self._reloading:
            self._reloading = False
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            if self.clock is not None:
                self.outcome["load_seconds"] = self.clock.load_seconds()
            # The proof of load, taken here rather than in a call of its own: the replica is paused until the
            # manager has compared it (``VllmEngineActor.load_checksums``).
            self.outcome["load_checksums"] = parameter_checksums(self.model)

    def as_peer(self, method: str, kwargs: Mapping[str, Any]) -> Any:
        """``PeerWorker.execute_as_peer``: a step of this worker's engine for serving a joining replica."""
        return asyncio.run(self._require_host("execute_as_peer").execute_as_peer(method, **kwargs))

    def serve(self, version: int) -> None:
        """``PeerWorker.serve_weights``, started: the kept copy of ``version`` to a joining replica, in a thread."""
        self.serving.start(self._require_host("serve_weights"), version)

    def finalize(self) -> None:
        if self._host is not None:
            self._host.execute_sync("finalize")

    def shutdown(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            host.execute_sync("close")

    # -- loading ---------------------------------------------------------------------------------------------------

    def _require_host(self, step: str) -> EngineHost:
        if self._host is None:
            raise LifecycleError(f"{step} before weightsync_prepare: the manager prepares every worker first")
        return self._host

    def begin_reload(self) -> LoadClock:
        """Start vLLM's layerwise reload; the clock that times it."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.clock = LoadClock()
        cpu = time.thread_time()
        initialize_layerwise_reload(self.model)
        self.reload_cpu = time.thread_time() - cpu  # vLLM's, on the stream's thread: not the stream's CPU
        self._reloading = True
        return self.clock

    def _abandon_reload(self) -> None:
        """After a failed update: finish the reload with what arrived; layers that got nothing are put back."""
        if self._reloading:
            with contextlib.suppress(Exception):  # the update's own error is the one to report
                self.finish_weight_update()


class _Loader:
    """The ``WeightSink`` that feeds one update into vLLM's loader.

    ``model.load_weights`` is synchronous and pulls from an iterator, while weightsync's stream is asynchronous: the
    loader runs in a thread and takes each tensor from the stream on this event loop.
    """

    def __init__(self, engine: WeightsyncTransferEngine, *, copy: str) -> None:
        self._engine = engine
        self.notes = internals.notes("layer_progress", "mtp_check", *(("held_arguments",) if copy == "held" else ()))
        """What this update goes without (``weightsync.vllm.internals.notes``)."""
        self._copy = "all" if copy == "held" and not internals.usable("held_arguments") else copy

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        loop = asyncio.get_running_loop()
        timeout = self._engine._timeout + 30.0  # the stream's own waits have deadlines; this only bounds a bug
        def pull() -> list[tuple[str, torch.Tensor]] | None:
            return asyncio.run_coroutine_threadsafe(next_batch(weights), loop).result(timeout)

        first = await next_batch(weights)  # nothing is touched until a tensor has arrived (module docstring, point 1)
        if first is None:
            return
        clock = self._engine.begin_reload()
        await asyncio.to_thread(self._load, first, pull, clock)

    def _load(self, first: list[tuple[str, torch.Tensor]], pull: Any, clock: LoadClock) -> None:
        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for batch in itertools.chain([first], iter(pull, None)):
                for name, tensor in batch:
                    yield name, tensor.clone() if self._copy == "all" else tensor
                if self._copy == "held":  # vLLM asks for the tensor after this batch: its views are about to go
                    internals.copy_held(batch, self._engine.kept)

        model: Any = self._engine.model
        with internals.mtp_check_disabled():
            model.load_weights(weights=clock.iterate(stream()))
        missing = internals.missing_layers(model)
        if missing:
            raise LoadVerificationError(
                f"the update left {len(missing)} module(s) of vLLM's model without weights, first "
                f"{missing[0]!r}: the sender's stream lacks their tensors", replica="", parameter=missing[0],
            )


def engine_in_process() -> WeightsyncTransferEngine:
    """The ``WeightsyncTransferEngine`` vLLM built in this worker process (weightsync's own record of it)."""
    engine = _in_process() if _in_process is not None else None
    if engine is None:
        raise ConfigError("this vLLM engine was not started with weight_transfer_config={'backend': 'weightsync'}: "
                          "its worker holds no weightsync engine")
    return engine


# -- outcomes across vLLM's RPC (which carries exceptions as strings) ---------------------------------------------


def error_to_data(exc: BaseException) -> dict[str, Any]:
    """An error as plain data: its class name, message, details and whether it left the model untouched."""
    details = dict(exc.details) if isinstance(exc, WeightsyncError) else {}
    details.pop("untouched", None)
    return {"type": type(exc).__name__, "message": exc.message if isinstance(exc, WeightsyncError) else str(exc),
            "details": {k: v for k, v in details.items() if isinstance(v, (str, int, float, bool, list, tuple))},
            "untouched": is_untouched(exc)}


def error_from_data(data: Mapping[str, Any], *, where: str) -> BaseException:
    """The typed weightsync error ``error_to_data`` described (a ``WorkerError`` for anything else)."""
    cls = getattr(errors, str(data.get("type")), None)
    message = str(data.get("message", ""))
    error: BaseException
    if isinstance(cls, type) and issubclass(cls, WeightsyncError):
        details = dict(data.get("details") or {})
        if details.get("replica") == "":  # raised inside vLLM's worker, which does not know its replica's name
            details["replica"] = where
        error = cls(message, **details)
    else:
        error = errors.WorkerError(f"{where}: {data.get('type')}: {message}", worker=where, step="transfer")
    if data.get("untouched"):
        mark_untouched(error)
    return error

