"""checkpoint-engine's collectives on private process groups, so that kimi runs in a process whose default
``torch.distributed`` group belongs to someone else (an FSDP/Megatron rank, a vLLM worker: every verl worker).

Why this is possible
--------------------
checkpoint-engine 0.4.2's ``ParameterServer`` never calls ``torch.distributed`` collectives itself: ``ps.py``
imports ``checkpoint_engine.distributed as dist`` and calls ``dist.init_process_group`` (in
``ParameterServer.init_process_group``, over a ``PrefixStore`` of the PS's own ``TCPStore``),
``dist.all_gather_object`` (``gather_metas``), ``dist.new_group``,
``dist.broadcast``, ``dist.all_reduce``, ``dist.barrier`` and ``dist.destroy_process_group`` (``update`` and
``_update_per_bucket``). Those module functions (``checkpoint_engine/distributed/base.py``) forward to one process-wide
implementation of its ``Distributed`` ABC. The default one, ``TorchBackend``, calls
``torch.distributed.init_process_group``: the *default* group, hence the old refusal. ``use_backend("vllm_nccl")``
(or ``"vllm_hccl"``) swaps in vLLM's stateless communicators, which needs vLLM installed; there is no public way to
plug in another implementation, and ``ParameterServer`` accepts no group or store argument.

:class:`PrivateGroups` implements that ABC on groups built directly as ``ProcessGroupNCCL`` (``ProcessGroupGloo``
where checkpoint-engine asks for gloo) over a ``PrefixStore`` of the store checkpoint-engine hands over, the way the
``nccl`` backend builds its group: never registered with ``torch.distributed``, so the caller's default group and
``torch.distributed.group.WORLD`` stay exactly as they were. ``CheckpointEngineLibrary.join_group`` installs it for
the epoch (the one private name we touch: ``checkpoint_engine.distributed.base._BACKEND_INSTANCE``, the slot
``use_backend`` fills) and puts the previous implementation back when the epoch ends.

``all_gather_object`` (checkpoint-engine's ``DataToGather`` metadata, a pydantic model) travels as the model's own
JSON, validated on receipt, not as pickle.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.api.errors import BackendUnavailableError
from weightsync.core.backend import c10d, memoryview_of

__all__ = ["PrivateGroup", "PrivateGroups", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = ("nccl", "gloo")
"""What checkpoint-engine may ask for: ``nccl`` on CUDA (its ``DeviceManager.backend``), ``gloo`` (CPU tests)."""


class PrivateGroup:
    """A group over some ParameterServer ranks: group rank ``i`` is PS rank ``ranks[i]``."""

    def __init__(self, backend: Any, *, ranks: Sequence[int], device: torch.device) -> None:
        self.backend = backend
        """The ``ProcessGroupNCCL``/``ProcessGroupGloo`` itself (its collectives are called directly)."""
        self.ranks = tuple(ranks)
        self.device = device

    def group_rank(self, ps_rank: int) -> int:
        if ps_rank not in self.ranks:
            raise ValueError(f"kimi: ParameterServer rank {ps_rank} is not in this group (PS ranks {self.ranks})")
        return self.ranks.index(ps_rank)

    def shutdown(self) -> None:
        self.backend.shutdown()


class PrivateGroups:
    """checkpoint-engine's ``Distributed`` interface (0.4.2) on private groups: one ParameterServer world's.

    Method names, positional order and ``group=None`` meaning "the PS world" are checkpoint-engine's; the library
    combines this class with ``checkpoint_engine.distributed.Distributed`` so that a missing method fails at once.
    """

    def __init__(self) -> None:
        self.world: PrivateGroup | None = None
        self._store: Any = None
        self._backend = "nccl"
        self._timeout = datetime.timedelta(minutes=10)
        self._ps_rank = 0
        self._created = 0
        """Groups made by ``new_group`` (collective: every PS rank counts each, so their store prefixes agree)."""

    @property
    def device(self) -> torch.device:
        """Where this world's collectives take their tensors."""
        return self._world().device

    def _world(self) -> PrivateGroup:
        if self.world is None:
            raise RuntimeError("kimi: the ParameterServer's private group is not initialised")
        return self.world

    def _group(self, group: PrivateGroup | None) -> PrivateGroup:
        return self._world() if group is None else group

    def _build(self, name: str, ranks: Sequence[int]) -> PrivateGroup:
        store = c10d.PrefixStore(f"weightsync-kimi/{name}", self._store)
        rank, size = list(ranks).index(self._ps_rank), len(ranks)
        if self._backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())  # the PS has set_device'd its GPU already
            options = c10d.ProcessGroupNCCL.Options()
            options._timeout = self._timeout
            with torch.cuda.device(device):
                return PrivateGroup(c10d.ProcessGroupNCCL(store, rank, size, options), ranks=ranks, device=device)
        return PrivateGroup(c10d.ProcessGroupGloo(store, rank, size, self._timeout), ranks=ranks,
                            device=torch.device("cpu"))

    # -- checkpoint_engine.distributed.Distributed -----------------------------------------------------------------

    def init_process_group(self, rank: int, world_size: int, store: Any, **kwargs: Any) -> None:
        if self.world is not None:
            raise RuntimeError("kimi: this ParameterServer's private group is initialised already")
        backend = str(kwargs.get("backend", "nccl"))
        if backend not in SUPPORTED_BACKENDS:
            reason = (f"checkpoint-engine asked for a {backend!r} group; weightsync-kimi builds its private groups "
                      f"for {' and '.join(SUPPORTED_BACKENDS)} only (on Ascend NPUs use the weightsync 'hccl' backend)")
            raise BackendUnavailableError(f"weightsync backend 'kimi' cannot run here: {reason}", backend="kimi",
                                          reason=reason)
        self._backend, self._store, self._ps_rank, self._created = backend, store, rank, 0
        self._timeout = kwargs.get("timeout", self._timeout)
        self.world = self._build("world", range(world_size))

    def destroy_process_group(self, group: PrivateGroup | None = None) -> None:
        if group is not None and group is not self.world:
            group.shutdown()
            return
        world, self.world = self.world, None
        if world is not None:
            world.shutdown()

    def is_initialized(self) -> bool:
        return self.world is not None

    def all_gather_object(self, object_list: list[Any], obj: Any, group: PrivateGroup | None = None) -> None:
        validate = getattr(type(obj), "model_validate_json", None)
        if validate is None or not hasattr(obj, "model_dump_json"):
            raise TypeError(f"kimi: all_gather_object exchanges checkpoint-engine's pydantic models as JSON (never "
                            f"pickle); got a {type(obj).__name__}")
        target = self._group(group)
        payload = obj.model_dump_json().encode()
        lengths = [torch.zeros(1, dtype=torch.int64, device=target.device) for _ in target.ranks]
        mine = torch.tensor([len(payload)], dtype=torch.int64, device=target.device)
        target.backend.allgather([lengths], [mine]).wait()
        sizes = [int(length.item()) for length in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        padded = padded.to(target.device)
        gathered = [torch.empty_like(padded) for _ in target.ranks]
        target.backend.allgather([gathered], [padded]).wait()
        for index, (data, size) in enumerate(zip(gathered, sizes)):
            object_list[index] = validate(bytes(memoryview_of(data[:size].cpu())))

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, group: PrivateGroup | None = None,
                   **kwargs: Any) -> None:
        options = c10d.AllreduceOptions()
        options.reduceOp = c10d.ReduceOp.SUM if op is None else op
        self._group(group).backend.allreduce([tensor], options).wait()

    def broadcast(self, tensor: torch.Tensor, src: int = 0, group: PrivateGroup | None = None, **kwargs: Any) -> None:
        target = self._group(group)
        options = c10d.BroadcastOptions()
        options.rootRank, options.rootTensor = target.group_rank(src), 0  # ``src`` is a PS rank, as in torch
        target.backend.broadcast([tensor], options).wait()

    def barrier(self, group: PrivateGroup | None = None, **kwargs: Any) -> None:
        target = self._group(group)
        token = torch.zeros(1, device=target.device)
        self.all_reduce(token, group=target)
        token.cpu()  # a host-side barrier on NCCL too: wait for the reduction itself, not only enqueue it

    def new_group(self, ranks: list[int], **kwargs: Any) -> PrivateGroup | None:
        """A group of ``ranks`` (PS ranks; all of them when empty). Every PS rank calls it, as in torch; those
        outside get None (checkpoint-engine skips the update on them)."""
        world = self._world()
        self._created += 1
        members = sorted(set(ranks)) if ranks else list(world.ranks)
        if self._ps_rank not in members:
            return None
        return self._build(f"group-{self._created}", members)
