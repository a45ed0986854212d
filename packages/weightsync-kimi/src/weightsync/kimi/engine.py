"""Backend ``kimi``: our lifecycle mapped onto MoonshotAI checkpoint-engine's ``ParameterServer`` (public API only).

The mapping
-----------
* The ParameterServer world is every worker of the epoch: actor rank i is PS rank i, rollout worker j is PS rank
  ``actor_wg_world_size + j``; PS rank 0 (actor rank 0) hosts the PS's ``TCPStore`` at the address it advertises in
  ``prepare()``.
* ``init_process_group``: builds this worker's ``ParameterServer(rank=, world_size=, auto_pg=False, master_addr=,
  master_port=)`` and calls its ``init_process_group(timeout=)``. The group lives as long as the epoch.
* ``send_weights`` on every actor rank: drains the stream, keeps its share (each tensor goes to the least-loaded
  actor rank, the same decision on every rank), copies the share to the host, then ``register_checkpoint(name,
  named_tensors=share)`` (checkpoint-engine pins it), ``gather_metas(name)``, the digest all-reduce, and
  ``update(name, req_func, ranks=...)``.
* ``receive_weights`` on every rollout worker: ``gather_metas``, the digest all-reduce, and the same ``update``
  call; its ``req_func`` serves the CUDA-IPC hand-off with checkpoint-engine's ``update_weights_from_ipc``, whose
  per-bucket callback feeds our async stream (views valid until the next item, as the Protocol says).
* ``finalize``: ``unregister_checkpoint(name)`` (the shared pinned pool, if used, is kept for the next update).
  ``close``: ``unregister_checkpoint(name, force=True)`` and ``destroy_process_group``.

Modes (option ``mode``): ``"broadcast"`` (default) — ``update(ranks=None)``: each bucket is copied host-to-device
by its owner and broadcast to every PS rank, actor ranks included (they discard it); the fastest when every rank
has a GPU link to every other. ``"p2p"`` — ``update(ranks=<rollout PS ranks>)``: rollout workers pull the shares
from the owners' pinned memory over RDMA (Mooncake; needs ``weightsync-kimi[p2p]`` and RDMA NICs); actor GPUs are
not touched, and new inference instances can join without disturbing serving ones.

What it requires, and when to choose it
---------------------------------------
* **Pinned host memory per actor rank** for its whole share of every update (the model divided by
  ``actor_wg_world_size``), registered by checkpoint-engine; ``shared_memory_pool=True`` (default) reuses one pinned
  pool across updates, which requires shares of a stable size (full-model updates). Set it to False for updates of
  varying content.
* **Its own process group.** The ParameterServer initialises ``torch.distributed``'s *default* group of the
  process, so every worker must run in a process without one — not inside an FSDP/Megatron rank or a vLLM worker.
  Building the group in such a process raises ``BackendUnavailableError`` instead of corrupting the trainer's.
* **One GPU per worker process**: the PS binds a CUDA-IPC socket named after its GPU's UUID and uses device
  ``rank % visible GPUs``; two workers on one GPU collide.
* ``bucket_bytes`` and ``slots`` are not used: checkpoint-engine sizes its two device buffers from free device memory
  (``mem_fraction``).
Choose it for disaggregated rollout fleets that benefit from sharded host-memory staging and P2P joins; prefer
``nccl`` for colocated actor and rollout GPUs in one process each.

The end-to-end digest is order-independent (see :mod:`weightsync.kimi.mapping`) and checked by each receiver when
``verify_digest`` is on; it costs one device-to-host copy of every received tensor.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from weightsync.api.protocols import copy_stream_into
from weightsync.api.errors import (
    BackendUnavailableError,
    ConcurrentUpdateError,
    ConfigError,
    DigestMismatchError,
    LifecycleError,
    TopologyError,
    TransferError,
)
from weightsync.api.types import (
    RankArgs,
    StageTiming,
    Topology,
    TransferReport,
    WorkerMetadata,
    WorldMetadata,
)
from weightsync.core.engine import BucketCheckpointEngine
from weightsync.core.planner import validate_pair
from weightsync.core.transport import ReceiverTransport, SenderTransport
from weightsync.kimi.mapping import MODES, Exchange, SetDigest, ShareAssigner, ps_rank
from weightsync.kimi.spec import CHECKPOINT_ENGINE_HINT, P2P_HINT

__all__ = ["KimiCheckpointEngine"]

Weights = list[tuple[str, torch.Tensor]]


def _import(module: str, hint: str) -> Any:
    """Import a checkpoint-engine module, turning its absence into the registry's kind of error."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = f"{module} does not import ({exc}); {hint}"
        raise BackendUnavailableError(f"weightsync backend 'kimi' cannot run here: {reason}", backend="kimi",
                                      reason=reason) from None


class KimiCheckpointEngine(BucketCheckpointEngine):
    """checkpoint-engine's ParameterServer behind our lifecycle. Options: ``mode``, ``mem_fraction``,
    ``shared_memory_pool`` (see the module docstring)."""

    name: ClassVar[str] = "kimi"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    option_names: ClassVar[frozenset[str]] = frozenset({"mode", "mem_fraction", "shared_memory_pool"})

    def __init__(self, *, bucket_bytes: int, **options: Any) -> None:
        super().__init__(bucket_bytes=bucket_bytes, **options)
        mode = self.options.get("mode", "broadcast")
        if mode not in MODES:
            raise ConfigError(f"kimi: mode must be one of {', '.join(MODES)}, got {mode!r}")
        mem_fraction = self.options.get("mem_fraction")
        if mem_fraction is not None and (isinstance(mem_fraction, bool) or not isinstance(mem_fraction, float)
                                         or not 0 < mem_fraction <= 1):
            raise ConfigError(f"kimi: mem_fraction must be a float in (0, 1], got {mem_fraction!r}")
        shared = self.options.get("shared_memory_pool", True)
        if not isinstance(shared, bool):
            raise ConfigError(f"kimi: shared_memory_pool must be a bool, got {shared!r}")
        self.mode: str = mode
        self.mem_fraction: float | None = mem_fraction
        self.shared_memory_pool = shared
        self._ps: Any = None
        self._rank_args: RankArgs = {}
        self._registered = False
        self._pool_in_use = False
        """Whether the shared pinned pool was allocated (finalize keeps it; closing the epoch frees it)."""

    # -- the seams to checkpoint-engine (tests replace these with fakes) ------------------------------------------

    def _new_parameter_server(self, **kwargs: Any) -> Any:
        ps_module = _import("checkpoint_engine.ps", CHECKPOINT_ENGINE_HINT)
        return ps_module.ParameterServer(**kwargs)

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        """Sum ``values`` over the PS group (its default group: checkpoint-engine's own ``all_reduce``)."""
        ce_dist = _import("checkpoint_engine.distributed", CHECKPOINT_ENGINE_HINT)
        tensor = torch.tensor(values, dtype=torch.int64, device=self._device())
        ce_dist.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return [int(value) for value in tensor.cpu().tolist()]

    def _serve_ipc(self, handle: str, run: Callable[[Weights], None]) -> None:
        """Be the inference side of the PS's CUDA-IPC hand-off on ``handle`` (a ZMQ address)."""
        worker = _import("checkpoint_engine.worker", CHECKPOINT_ENGINE_HINT)
        zmq = _import("zmq", CHECKPOINT_ENGINE_HINT)
        context = zmq.Context()
        try:
            worker.update_weights_from_ipc(context, handle, self._device().index or 0, run=run)
        finally:
            context.term()

    def _device_uuid(self) -> str:
        """How checkpoint-engine names this GPU in the IPC socket paths it hands to ``req_func``."""
        return f"GPU-{torch.cuda.get_device_properties(self._device()).uuid!s}"

    def _device(self) -> torch.device:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        rank = self._rank_args.get("ps_rank")
        # The PS uses device ``rank % visible GPUs`` (set_device in its constructor); so do we.
        return torch.device("cuda", rank % count) if count and isinstance(rank, int) else torch.device("cuda", 0)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def _prepare(self) -> WorkerMetadata:
        metadata: WorkerMetadata = {"mode": self.mode}
        if self.context.role == "actor" and self.context.rank == 0:
            metadata.update(master_addr=self.context.host_ip, master_port=_free_port(self.context.host_ip))
        return metadata

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        if actor_wg_world_size < 1 or rollout_world_size < 0:
            raise TopologyError(f"kimi: need actor_wg_world_size >= 1 and rollout_world_size >= 0, got "
                                f"{actor_wg_world_size} and {rollout_world_size}")
        if len(metadata.actor) != actor_wg_world_size or len(metadata.rollout) != rollout_world_size:
            raise TopologyError("kimi: metadata does not match actor_wg_world_size/rollout_world_size")
        modes = {entry.get("mode", "broadcast") for entry in [*metadata.actor, *metadata.rollout]}
        if len(modes) != 1:
            raise TopologyError(f"kimi: workers disagree on the mode option: {sorted(map(str, modes))}")
        mode = str(modes.pop())
        addr, port = metadata.actor[0].get("master_addr"), metadata.actor[0].get("master_port")
        if not isinstance(addr, str) or not isinstance(port, int):
            raise TopologyError("kimi: actor rank 0 did not advertise master_addr/master_port (was prepare() called?)")
        world = actor_wg_world_size + rollout_world_size
        update_ranks: list[int] = (
            [ps_rank(role="rollout", rank=j, actor_wg_world_size=actor_wg_world_size) for j in range(rollout_world_size)]
            if mode == "p2p" else []
        )
        common: RankArgs = {
            "master_addr": addr, "master_port": port, "ps_world_size": world, "mode": mode,
            "update_ranks": list[Any](update_ranks), "actor_wg_world_size": actor_wg_world_size, "sender": 0,
        }
        actor: list[RankArgs] = [
            {**common, "role": "sender", "ps_rank": ps_rank(role="actor", rank=i, actor_wg_world_size=actor_wg_world_size)}
            for i in range(actor_wg_world_size)
        ]
        rollout: list[RankArgs] = [
            {**common, "role": "receiver", "ps_rank": ps_rank(role="rollout", rank=j, actor_wg_world_size=actor_wg_world_size)}
            for j in range(rollout_world_size)
        ]
        # Every actor rank sends a disjoint share; each reports the digest of the whole update (after the exchange).
        return Topology(actor=actor, rollout=rollout, senders=tuple(range(actor_wg_world_size)))

    def init_process_group(self, *, rank_args: RankArgs) -> None:
        self._check_open()
        if self._busy.locked():
            raise ConcurrentUpdateError("kimi: init_process_group while an update is in flight")
        required = ("ps_rank", "ps_world_size", "master_addr", "master_port", "actor_wg_world_size", "epoch")
        missing = [key for key in required if key not in rank_args]
        if missing or rank_args.get("role") not in ("sender", "receiver"):
            raise TopologyError(f"kimi: rank_args lack {missing or ['role']}: {rank_args}")
        if self.mode == "p2p" and importlib.util.find_spec("mooncake") is None:
            raise BackendUnavailableError(f"weightsync backend 'kimi' cannot use mode='p2p' here: {P2P_HINT}",
                                          backend="kimi", reason=P2P_HINT)
        self._disconnect()
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reason = ("this process already has a default torch.distributed group (a trainer or inference "
                      "worker?); checkpoint-engine's ParameterServer needs the default group of a process of its own")
            raise BackendUnavailableError(f"weightsync backend 'kimi' cannot run here: {reason}", backend="kimi",
                                          reason=reason)
        self._rank_args = dict(rank_args)
        rank, world = int(str(rank_args["ps_rank"])), int(str(rank_args["ps_world_size"]))
        # checkpoint-engine reads ``rank or int(os.environ["RANK"])``: rank 0 counts as unset, so the documented
        # environment variables are set too (this process is the PS's own, see "Its own process group").
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        try:
            self._ps = self._new_parameter_server(
                rank=rank, world_size=world, auto_pg=False, mem_fraction=self.mem_fraction,
                master_addr=str(rank_args["master_addr"]), master_port=int(str(rank_args["master_port"])),
            )
            self._ps.init_process_group(timeout=datetime.timedelta(seconds=self.timeout))
        except BackendUnavailableError:
            raise
        except Exception as exc:  # checkpoint-engine validates with assert and raises plain RuntimeErrors
            self._ps = None
            raise TransferError(f"kimi: ParameterServer rank {rank} failed to join its group: {exc!r}",
                                peer="ParameterServer rank 0") from None
        self._role = "sender" if rank_args["role"] == "sender" else "receiver"
        self._epoch = str(rank_args["epoch"])
        self._sender_rank = 0

    @property
    def checkpoint_name(self) -> str:
        return f"weightsync-{(self._epoch or 'none')[:16]}"

    def _update_ranks(self) -> list[int] | None:
        ranks = self._rank_args.get("update_ranks")
        return [int(str(rank)) for rank in ranks] if isinstance(ranks, list) and ranks else None

    def _peer(self) -> str:
        return f"kimi ParameterServer group (this is PS rank {self._rank_args.get('ps_rank')})"

    def _connect_sender(self, rank_args: RankArgs) -> SenderTransport:
        raise LifecycleError("kimi: the ParameterServer is the transport; there is no bucket sender")

    def _connect_receiver(self, rank_args: RankArgs) -> ReceiverTransport:
        raise LifecycleError("kimi: the ParameterServer is the transport; there is no bucket receiver")

    def _disconnect(self) -> None:
        ps, self._ps = self._ps, None
        name = self.checkpoint_name  # of the epoch being left
        self._epoch = None
        self._role = None
        if ps is None:
            return
        try:
            if self._registered or self._pool_in_use:
                ps.unregister_checkpoint(name, force=True)
        finally:
            self._registered = self._pool_in_use = False
            ce_dist = _import("checkpoint_engine.distributed", CHECKPOINT_ENGINE_HINT)
            if ce_dist.is_initialized():
                ce_dist.destroy_process_group()

    def finalize(self) -> None:
        self._check_open()
        if self._ps is not None and self._registered:
            # Not forced: a shared pinned pool stays allocated for the next update of this epoch.
            self._ps.unregister_checkpoint(self.checkpoint_name)
            self._registered = False

    # -- sending --------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int = 0) -> TransferReport:
        self._require("sender", "send_weights")
        if self._role != "sender" or self._ps is None:
            raise LifecycleError(f"kimi: send_weights on a rank whose role is {self._role}")
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUpdateError("kimi: send_weights while another update is in flight")
        started = time.perf_counter()
        try:
            share, digest = await self._collect_share(weights)
            collected = time.perf_counter()
            loop = asyncio.get_running_loop()
            exchange = await loop.run_in_executor(self._transfer_pool, self._send_blocking, share, digest, version)
        finally:
            self._busy.release()
        return TransferReport(
            role="actor", rank=self.context.rank, version=version, nbytes=digest.nbytes, tensors=digest.tensors,
            buckets=0, seconds=time.perf_counter() - started, digest=exchange.digest, sender=self.context.rank,
            stages=(StageTiming(stage="offload", seconds=collected - started),
                    StageTiming(stage="update", seconds=time.perf_counter() - collected)),
        )

    async def _collect_share(self, weights: Iterable[object]) -> tuple[dict[str, torch.Tensor], SetDigest]:
        """Drain the whole stream (gathering may be collective); keep and hash this rank's share on the host."""
        actor_world = int(str(self._rank_args["actor_wg_world_size"]))
        assigner = ShareAssigner(actor_wg_world_size=actor_world)
        seen: set[str] = set()
        share: dict[str, torch.Tensor] = {}
        digest = SetDigest()
        for count, item in enumerate(weights, start=1):
            name, tensor = validate_pair(item, devices=self.devices | {"cpu"}, seen=seen)
            if assigner.owner(tensor.numel() * tensor.element_size()) == self.context.rank:
                host = tensor.detach().to("cpu", copy=True).contiguous()
                share[name] = host
                digest.add(name, host)
            if count % 64 == 0:
                await asyncio.sleep(0)
        return share, digest

    def _send_blocking(self, share: dict[str, torch.Tensor], digest: SetDigest, version: int) -> Exchange:
        ps = self._ps
        name = self.checkpoint_name
        try:
            ps.register_checkpoint(name, named_tensors=share, use_shared_memory_pool=self.shared_memory_pool)
            self._registered = True
            self._pool_in_use = self._pool_in_use or self.shared_memory_pool
            ps.gather_metas(name)
            exchange = Exchange.from_sum(self._all_reduce_sum(
                Exchange.contribution(digest, version=version if self.context.rank == 0 else None)))
            ps.update(name, self._discard_req_func, timeout=datetime.timedelta(seconds=self.timeout),
                      ranks=self._update_ranks())
        except (BackendUnavailableError, TopologyError):
            raise
        except Exception as exc:
            raise TransferError(f"kimi: update failed on actor rank {self.context.rank}: {exc!r}",
                                peer=self._peer()) from None
        return exchange

    def _discard_req_func(self, socket_paths: list[tuple[str, str]]) -> None:
        """An actor rank's PS also receives every bucket in broadcast mode; its IPC consumer drops them."""
        self._serve_ipc(self._socket_for_this_device(socket_paths), lambda weights: None)

    def _socket_for_this_device(self, socket_paths: list[tuple[str, str]]) -> str:
        uuid = self._device_uuid()
        for device_uuid, path in socket_paths:
            if device_uuid == uuid:
                return path
        raise TransferError(f"kimi: no IPC socket for this GPU ({uuid}) among {[u for u, _ in socket_paths]}",
                            peer=self._peer())

    # -- receiving ------------------------------------------------------------------------------------------------

    def receive_weights(self) -> _KimiStream:
        self._require("receiver", "receive_weights")
        if self._ps is None:
            raise LifecycleError("kimi: receive_weights before init_process_group")
        if not self._busy.acquire(blocking=False):
            raise ConcurrentUpdateError("kimi: receive_weights while another update is in flight")
        return _KimiStream(self)

    def _receive_blocking(self, stream: _KimiStream) -> Exchange:
        ps = self._ps
        name = self.checkpoint_name
        try:
            ps.gather_metas(name)
            exchange = Exchange.from_sum(self._all_reduce_sum(Exchange.contribution(None, version=None)))
            stream.expected = exchange

            def req_func(socket_paths: list[tuple[str, str]]) -> None:
                try:
                    self._serve_ipc(self._socket_for_this_device(socket_paths), stream.deliver)
                except BaseException as exc:
                    stream.fail(exc)
                    raise

            ps.update(name, req_func, timeout=datetime.timedelta(seconds=self.timeout), ranks=self._update_ranks())
        except (BackendUnavailableError, TopologyError, TransferError):
            raise
        except Exception as exc:
            raise TransferError(f"kimi: update failed on rollout rank {self.context.rank}: {exc!r}",
                                peer=self._peer()) from None
        return exchange


class _KimiStream:
    """``ReceivedWeights`` over checkpoint-engine's per-bucket IPC callback.

    The callback (on checkpoint-engine's IPC thread) hands a bucket's ``(name, tensor)`` views to the event loop and
    waits until the consumer asks for the item after the bucket's last one: the views stay valid exactly as long as
    the Protocol promises, and checkpoint-engine reuses the buffer only after the callback returns.
    """

    def __init__(self, engine: KimiCheckpointEngine) -> None:
        self.report: TransferReport | None = None
        self.expected: Exchange | None = None
        self._engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Weights | BaseException | None] | None = None
        self._bucket: Weights = []
        self._position = 0
        self._consumed: threading.Event | None = None
        self._consumed_next: threading.Event | None = None
        self._digest = SetDigest()
        self._tensors = 0
        self._buckets = 0
        self._started = time.perf_counter()
        self._finished = False
        self._closed = threading.Event()

    def __aiter__(self) -> _KimiStream:
        return self

    def deliver(self, weights: Weights) -> None:
        """checkpoint-engine's ``run`` callback: one bucket, valid until this returns."""
        loop, queue = self._loop, self._queue
        if loop is None or queue is None or self._closed.is_set():
            return
        if self._engine.verify_digest:
            for name, tensor in weights:
                self._digest.add(name, tensor)
        consumed = threading.Event()
        loop.call_soon_threadsafe(self._hand_over, list(weights), consumed)
        deadline = time.monotonic() + self._engine.timeout
        while not consumed.wait(0.05):
            if self._closed.is_set():
                return
            if time.monotonic() > deadline:
                raise TransferError("kimi: the consumer did not take a bucket in time", peer="local consumer")

    def _hand_over(self, weights: Weights, consumed: threading.Event) -> None:
        if self._queue is not None:
            self._consumed_next = consumed
            self._queue.put_nowait(weights)

    def fail(self, exc: BaseException) -> None:
        loop, queue = self._loop, self._queue
        if loop is not None and queue is not None and not loop.is_closed():
            loop.call_soon_threadsafe(queue.put_nowait, exc)

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Callable[[str, torch.Tensor], object] | None = None,
    ) -> int:
        """checkpoint-engine hands over its own views; nothing faster than copying each (see ``copy_stream_into``)."""
        return await copy_stream_into(self, destinations, fallback=fallback)

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        if self._finished:
            raise StopAsyncIteration
        if self._queue is None:
            self._loop = asyncio.get_running_loop()
            self._queue = asyncio.Queue()
            future = self._loop.run_in_executor(self._engine._transfer_pool, self._engine._receive_blocking, self)
            future.add_done_callback(self._update_done)
        try:
            while True:
                if self._position < len(self._bucket):
                    item = self._bucket[self._position]
                    self._position += 1
                    self._tensors += 1
                    return item
                if self._consumed is not None:
                    self._consumed.set()
                    self._consumed = None
                arrived = await self._queue.get()
                if isinstance(arrived, BaseException):
                    raise arrived
                if arrived is None:
                    self._complete()
                    raise StopAsyncIteration
                self._bucket, self._position = arrived, 0
                self._consumed = self._consumed_next
                self._buckets += 1
        except BaseException:
            self._close()
            raise

    def _update_done(self, future: asyncio.Future[Exchange]) -> None:
        queue = self._queue
        if queue is None:
            return
        error = future.exception() if not future.cancelled() else asyncio.CancelledError()
        queue.put_nowait(error if error is not None else None)

    def _complete(self) -> None:
        engine = self._engine
        try:
            expected = self.expected
            if expected is None:
                raise TransferError("kimi: the update ended before the digest exchange", peer=engine._peer())
            if engine.verify_digest and expected.digest != self._digest.hexdigest():
                raise DigestMismatchError(
                    f"rollout rank {engine.context.rank} received tensors whose digest {self._digest.hexdigest()[:16]} "
                    f"differs from the actor ranks' {expected.digest[:16]}: the update was corrupted in transit",
                    receiver=engine.context.rank, expected=expected.digest, actual=self._digest.hexdigest(),
                )
            self.report = TransferReport(
                role="rollout", rank=engine.context.rank, version=expected.version, nbytes=expected.nbytes,
                tensors=self._tensors, buckets=self._buckets, seconds=time.perf_counter() - self._started,
                digest=expected.digest if not engine.verify_digest else self._digest.hexdigest(), sender=0,
            )
        finally:
            self._close()

    async def aclose(self) -> None:
        """The consumer leaves early: checkpoint-engine's remaining buckets are let through untaken."""
        self._close()

    def _close(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._closed.set()
        if self._consumed is not None:
            self._consumed.set()
        self._engine._busy.release()


def _free_port(host: str) -> int:
    """A port free right now on ``host`` for the PS's TCPStore (checkpoint-engine binds it itself, later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
