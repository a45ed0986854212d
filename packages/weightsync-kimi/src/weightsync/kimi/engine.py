"""Backend ``kimi``: our lifecycle mapped onto MoonshotAI checkpoint-engine's ``ParameterServer`` (public API only).

The mapping
-----------
* The ParameterServer world is every worker of the epoch: actor rank i is PS rank i, rollout worker j is PS rank
  ``actor_wg_world_size + j``; PS rank 0 (actor rank 0) hosts the PS's ``TCPStore`` at the address it advertises in
  ``prepare()``.
* ``init_process_group``: builds this worker's ``ParameterServer(rank=, world_size=, auto_pg=False, master_addr=,
  master_port=)`` and calls its ``init_process_group(timeout=)`` with checkpoint-engine's collectives on private
  groups (not the process's default group). The group lives as long as the epoch.
* ``send_weights`` on every actor rank: drains the stream, keeps its share (each tensor goes to the least-loaded
  actor rank, the same decision on every rank), copies the share to the host, then ``register_checkpoint(name,
  named_tensors=share)`` (checkpoint-engine pins it), ``gather_metas(name)``, the digest all-reduce, and
  ``update(name, req_func, ranks=...)``.
* ``receive_weights`` on every rollout worker: ``gather_metas``, the digest all-reduce, and the same ``update``
  call; its ``req_func`` serves the CUDA-IPC hand-off with checkpoint-engine's ``update_weights_from_ipc``, whose
  per-bucket callback feeds our async stream (views valid until the next item, as the Protocol says).
* ``finalize``: ``unregister_checkpoint(name)`` (the shared pinned pool, if used, is kept for the next update).
  ``close``: ``unregister_checkpoint(name, force=True)`` and ``destroy_process_group`` (of the private groups).

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
* **No default group of its own.** The ParameterServer's collectives run on private groups (``ProcessGroupNCCL``
  over a ``PrefixStore`` of the PS's ``TCPStore``, see :mod:`weightsync.kimi.groups`), so a worker may live in an
  FSDP/Megatron rank or a vLLM worker whose default ``torch.distributed`` group exists: that group, and ``RANK`` /
  ``WORLD_SIZE`` in the environment, are left as they were. checkpoint-engine's collectives are process-wide, so
  one kimi engine per process (a second one's ``init_process_group`` raises ``BackendUnavailableError``).
* **One GPU per worker process**: the PS binds a CUDA-IPC socket named after its GPU's UUID and uses device
  ``rank % visible GPUs``; two workers on one GPU collide.
* ``bucket_bytes`` and ``slots`` are not used: checkpoint-engine sizes its two device buffers from free device memory
  (``mem_fraction``).
Choose it for disaggregated rollout fleets that benefit from sharded host-memory staging and P2P joins; prefer
``nccl`` for colocated actor and rollout GPUs in one process each.

The end-to-end digest is order-independent (see :mod:`weightsync.kimi.mapping`) and checked by each receiver when
``verify_digest`` is on; it costs one device-to-host copy of every received tensor.

How it is built
---------------
checkpoint-engine packs, buckets and moves the weights itself, so none of core's bucket pipeline applies: the engine
implements the ``CheckpointEngine`` Protocol directly, on core's public pieces (``weightsync.core.backend``):
``EngineBase`` (settings parsed once, as attributes), ``guard_build_topology``, ``Handover`` (one update at a time),
``decode_plan`` and ``validate_pair``. The rest is kimi's own: :mod:`~weightsync.kimi.mapping` (options, the topology
and its typed plans, shares, digest), :mod:`~weightsync.kimi.library` (every call into checkpoint-engine),
:mod:`~weightsync.kimi.groups` (its collectives on private groups), :mod:`~weightsync.kimi.group` (one epoch's
ParameterServer) and :mod:`~weightsync.kimi.stream` (the receive stream).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from weightsync.api.errors import (
    BackendUnavailableError,
    ConcurrentUpdateError,
    ConfigError,
    LifecycleError,
)
from weightsync.api.types import (
    RankArgs,
    PhaseTiming,
    Topology,
    TransferReport,
    WorkerMetadata,
    WorldMetadata,
)
from weightsync.core.backend import EngineBase, Handover, decode_plan, guard_build_topology
from weightsync.kimi.group import ParameterServerGroup
from weightsync.kimi.library import CheckpointEngineLibrary
from weightsync.kimi.mapping import (
    JoinArgs, KimiOptions, KimiPlan, collect_share, parameter_server_topology)
from weightsync.kimi.spec import P2P_HINT
from weightsync.kimi.stream import KimiStream

__all__ = ["KimiCheckpointEngine"]


class KimiCheckpointEngine(EngineBase):
    """checkpoint-engine's ParameterServer behind our lifecycle. Options: ``mode``, ``mem_fraction``,
    ``shared_memory_pool`` (see the module docstring); ``bucket_bytes`` and ``slots`` are validated, then unused."""

    name: ClassVar[str] = "kimi"
    devices: ClassVar[frozenset[str]] = frozenset({"cuda"})
    option_names: ClassVar[frozenset[str]] = KimiOptions.NAMES
    default_slots: ClassVar[int] = 2
    supports_delta: ClassVar[bool] = False

    def __init__(self, *, bucket_bytes: int, **options: Any) -> None:
        super().__init__(bucket_bytes=bucket_bytes, **options)
        if self.settings.delta:  # supports_delta
            # checkpoint-engine moves whole tensors through its own buffers: there is no bucket to encode.
            raise ConfigError("the kimi backend sends full updates only; use SyncConfig(delta=False) with it")
        self.options = KimiOptions.parse(self.settings.options)
        self.library = CheckpointEngineLibrary()
        """Every call into checkpoint-engine goes through it (the tests put a fake in its place)."""
        self._handover = Handover(self.name, self.settings.timeout)
        # One thread: the update's blocking calls (collectives, the IPC hand-off) run there, one update at a time.
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ws-kimi-update")
        self._group: ParameterServerGroup | None = None

    @property
    def epoch(self) -> str | None:
        return self._group.args.epoch if self._group is not None else None

    @property
    def role(self) -> str | None:
        return self._group.args.role if self._group is not None else None

    # -- lifecycle -------------------------------------------------------------------------------------------------

    def prepare(self) -> WorkerMetadata:
        self._check_open()
        context = self.settings.context
        metadata = {**self.settings.metadata(), "mode": self.options.mode}  # read as KimiMetadata
        if context.role == "actor" and context.rank == 0:  # PS rank 0 hosts the ParameterServer's TCPStore
            metadata.update(master_addr=context.host_ip, master_port=_free_port(context.host_ip))
        return metadata

    @classmethod
    def build_topology(
        cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
    ) -> Topology:
        return parameter_server_topology(
            actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata)

    def init_process_group(self, *, rank_args: RankArgs) -> None:
        self._check_open()
        if self._handover.in_flight:
            raise ConcurrentUpdateError("kimi: init_process_group while an update is in flight")
        if self.options.mode == "p2p" and not self.library.p2p_available():
            raise BackendUnavailableError(f"weightsync backend 'kimi' cannot use mode='p2p' here: {P2P_HINT}",
                                          backend="kimi", reason=P2P_HINT)
        args: JoinArgs = decode_plan(rank_args, KimiPlan, who="kimi")
        self._leave()
        self._group = ParameterServerGroup.join(library=self.library, settings=self.settings, options=self.options,
                                                args=args)

    def finalize(self) -> None:
        self._check_open()
        if self._group is not None:
            self._group.finalize()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._leave()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _leave(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.leave()

    def _joined(self, role: str, what: str) -> ParameterServerGroup:
        """This epoch's group, for a step that only a rank of ``role`` takes."""
        self._check_open()
        group = self._group
        if group is None:
            raise LifecycleError(f"{what} before init_process_group on this {self.name} engine")
        if group.args.role != role:
            raise LifecycleError(f"kimi: {what} on a rank whose role in this topology is {group.args.role}")
        return group

    # -- the update ------------------------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int = 0) -> TransferReport:
        group = self._joined("sender", "send_weights")
        self._handover.acquire_for("send_weights")
        rank = self.settings.context.rank
        started = time.perf_counter()
        try:
            share, digest = await collect_share(weights, rank=rank, actor_wg_world_size=group.args.actor_wg_world_size,
                                                devices=self.devices | {"cpu"})
            collected = time.perf_counter()
            loop = asyncio.get_running_loop()
            exchange = await loop.run_in_executor(self._pool, group.send, share, digest, version)
        finally:
            self._handover.release()
        return TransferReport(
            role="actor", rank=rank, version=version, nbytes=digest.nbytes, tensors=digest.tensors, buckets=0,
            seconds=time.perf_counter() - started, digest=exchange.digest, sender=rank,
            phases=(PhaseTiming(phase="offload", seconds=collected - started),
                    PhaseTiming(phase="update", seconds=time.perf_counter() - collected)),
        )

    def receive_weights(self) -> KimiStream:
        group = self._joined("receiver", "receive_weights")
        hold = self._handover.hold_for_stream()
        return KimiStream(self.settings, hold=hold, pool=self._pool, update=group.receive, peer=group.peer)


# The guard (old calling conventions, sizes against the metadata, the epoch stamp), applied as core's engine
# applies it; the class is passed in, so its errors name KimiCheckpointEngine.
setattr(KimiCheckpointEngine, "build_topology",
        classmethod(guard_build_topology(vars(KimiCheckpointEngine)["build_topology"].__func__)))


def _free_port(host: str) -> int:
    """A port free right now on ``host`` for the PS's TCPStore (checkpoint-engine binds it itself, later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
