"""Worker processes for ``test_kimi_default_group``: each is a "trainer" rank whose default gloo group exists
before kimi arrives (as in every verl worker); a mode says what then happens to that group.

checkpoint-engine's ParameterServer needs a CUDA device only through its ``DeviceManager`` (``set_device``, the
GPU's UUID, ``backend == "nccl"``); here a CPU stand-in says ``gloo``, so the real ParameterServer, its real TCPStore
and the real group setup (``ParameterServer.init_process_group`` → ``checkpoint_engine.distributed`` → kimi's
private groups) run on CPU. Transfers (pinned memory, CUDA IPC) cannot, and are not attempted.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from weightsync.api.types import RankArgs, Role, Topology, WorkerContext, WorldMetadata
from weightsync.core.backend import c10d
from weightsync.kimi.engine import KimiCheckpointEngine
from weightsync.kimi.library import CheckpointEngineLibrary, ParameterServer

__all__ = ["run_worker", "default_group_problems", "kimi_role"]

ACTORS = 2
"""Processes 1..2 are actor ranks 1, 0 (PS ranks 1, 0); process 0 is rollout rank 0 (PS rank 2): the PS world's
order is the reverse of the default group's, so a default group taken over by the PS would show it."""


def kimi_role(index: int) -> tuple[Role, int]:
    return ("rollout", 0) if index == 0 else ("actor", ACTORS - index)


class CpuDeviceManager:
    """checkpoint_engine.device_utils.DeviceManager's surface that the PS touches up to ``gather_metas``."""

    device_type = "cpu"
    backend = "gloo"

    def __init__(self) -> None:
        uuid = f"cpu-{os.getpid()}"
        self.device_module = SimpleNamespace(
            device_count=lambda: 1, set_device=lambda index: None, empty_cache=lambda: None,
            get_device_properties=lambda index: SimpleNamespace(uuid=uuid),
        )


class CpuLibrary(CheckpointEngineLibrary):
    """The real library, with the ParameterServer built on :class:`CpuDeviceManager`; remembers the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.server: Any = None

    def new_parameter_server(self, **kwargs: Any) -> ParameterServer:
        setattr(importlib.import_module("checkpoint_engine.ps"), "DeviceManager", CpuDeviceManager)
        self.server = super().new_parameter_server(**kwargs)
        return self.server  # type: ignore[no-any-return]


def default_group_problems(world: Any, rank: int, size: int) -> list[str]:
    """What is wrong with the caller's default group, checked by using it ([] when it is intact and works)."""
    if not dist.is_initialized():
        return ["there is no default group any more"]
    problems = []
    if dist.group.WORLD is not world:
        problems.append("torch.distributed.group.WORLD is another group")
    if (dist.get_rank(), dist.get_world_size()) != (rank, size):
        problems.append(f"rank/size are {dist.get_rank()}/{dist.get_world_size()}, not {rank}/{size}")
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, torch.tensor([rank]))
    if [int(value) for value in gathered] != list(range(size)):
        problems.append(f"an all_gather of the caller's ranks gave {[int(value) for value in gathered]}")
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)
    if int(total) != size * (size + 1) // 2:
        problems.append(f"an all_reduce gave {int(total)}, not {size * (size + 1) // 2}")
    return problems


def _topology(engine: KimiCheckpointEngine, index: int, size: int) -> RankArgs:
    """prepare() here, build_topology on process 0 (the driver), each process's arguments back: over the
    caller's default group, which is thereby in use while kimi sets up."""
    role, rank = kimi_role(index)
    metadata: list[Any] = [None] * size
    dist.all_gather_object(metadata, (role, rank, engine.prepare()))
    box: list[Any] = [None]
    if index == 0:
        by_rank = {(r, k): m for r, k, m in metadata}
        world = WorldMetadata(actor=[by_rank["actor", k] for k in range(ACTORS)],
                              rollout=[by_rank["rollout", k] for k in range(size - ACTORS)])
        box[0] = KimiCheckpointEngine.build_topology(actor_wg_world_size=ACTORS, rollout_world_size=size - ACTORS,
                                                     metadata=world)
    dist.broadcast_object_list(box, src=0)
    topology: Topology = box[0]
    return topology.actor[rank] if role == "actor" else topology.rollout[rank]


def _private_group_checks(library: CpuLibrary, ps_rank: int, size: int) -> dict[str, Any]:
    """The PS world's collectives, through checkpoint-engine's own entry points, while the default group lives."""
    ce_dist = importlib.import_module("checkpoint_engine.distributed")
    data_types = importlib.import_module("checkpoint_engine.data_types")
    meta = data_types.ParameterMeta(name=f"w{ps_rank}", dtype=torch.bfloat16, shape=torch.Size([ps_rank, 3]),
                                    aligned_size=64 * ps_rank)
    mine = data_types.DataToGather(
        memory_buffer_metas_list=[data_types.MemoryBufferMetas(metas=[meta], ptr=ps_rank, size=64)],
        p2p_store_addr=None, host_ip=f"ps-{ps_rank}", device_uuid=f"uuid-{ps_rank}", rdma_device="")
    gathered: list[Any] = [None] * size
    ce_dist.all_gather_object(gathered, mine)
    library.server.gather_metas("kimi-default-group")  # checkpoint-engine's own use of all_gather_object
    sub = ce_dist.new_group([2, 1])  # as update(ranks=...) builds it: every PS rank calls, members get a group
    received = None
    if sub is not None:
        tensor = torch.tensor([100 + ps_rank])
        ce_dist.broadcast(tensor, src=2, group=sub)  # src is a PS rank (group rank 1 of (1, 2))
        ce_dist.barrier(group=sub)
        ce_dist.destroy_process_group(sub)
        received = int(tensor)
    library.server.store_based_barrier()
    return {
        "gathered": [(item.host_ip, item.device_uuid, [m.model_dump() for b in item.memory_buffer_metas_list
                                                      for m in b.metas]) for item in gathered],
        "sum": library.all_reduce_sum([ps_rank + 1, 7], ps_rank=ps_rank),
        "subgroup": None if sub is None else received,
        "dtype": str(gathered[2].memory_buffer_metas_list[0].metas[0].dtype),
    }


def _kimi_epochs(index: int, size: int, world: Any) -> dict[str, Any]:
    """Two epochs of kimi in this process: prepare, topology, init_process_group, its group used, finalize; close."""
    role, rank = kimi_role(index)
    engine = KimiCheckpointEngine(bucket_bytes=1 << 16, timeout=60,
                                  context=WorkerContext(role=role, rank=rank, node_id="n", host_ip="127.0.0.1"))
    library = CpuLibrary()
    engine.library = library
    ce_base = importlib.import_module("checkpoint_engine.distributed.base")
    stock = ce_base._BACKEND_INSTANCE
    report: dict[str, Any] = {"epochs": []}
    try:
        for _ in range(2):
            args = _topology(engine, index, size)
            engine.init_process_group(rank_args=args)
            ps_rank = args["ps_rank"]
            assert isinstance(ps_rank, int)
            checks = _private_group_checks(library, ps_rank, size)
            checks.update(ps_rank=ps_rank, during=default_group_problems(world, index, size),
                          installed=type(ce_base._BACKEND_INSTANCE).__name__)
            engine.finalize()
            report["epochs"].append(checks)
    finally:
        engine.close()
    report["restored"] = ce_base._BACKEND_INSTANCE is stock
    return report


def _replace(index: int, size: int, store: Any) -> dict[str, Any]:
    """What checkpoint-engine's stock path does with the default group: it cannot be initialised a second time,
    and once the caller's is destroyed, the PS's world (in its own rank order) becomes the default group."""
    ce_dist = importlib.import_module("checkpoint_engine.distributed")
    ps_rank = kimi_role(index)[1] + (0 if kimi_role(index)[0] == "actor" else ACTORS)
    try:
        ce_dist.init_process_group(ps_rank, size, c10d.PrefixStore("ps", store), backend="gloo")
        refused = ""
    except (RuntimeError, ValueError) as exc:
        refused = str(exc)
    ce_dist.destroy_process_group()
    ce_dist.init_process_group(ps_rank, size, c10d.PrefixStore("ps", store), backend="gloo")
    return {"refused": refused}


def run_worker(index: int, size: int, port: int, mode: str, results: Any) -> None:
    """One process: default gloo group (caller rank ``index``), then ``mode`` ("kimi", "destroy", "replace"), then
    the default-group check; puts ``(index, report)`` on ``results``."""
    try:
        sys.modules["mooncake"] = None  # type: ignore[assignment]  # no RDMA store: the PS logs and goes without
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(index), str(size)  # as torchrun sets them
        store = c10d.TCPStore("127.0.0.1", port, size, is_master=index == 0)
        dist.init_process_group("gloo", store=c10d.PrefixStore("trainer", store), rank=index, world_size=size)
        world = dist.group.WORLD
        report: dict[str, Any] = {"before": default_group_problems(world, index, size)}
        if mode == "kimi":
            report.update(_kimi_epochs(index, size, world))
        elif mode == "destroy":
            dist.destroy_process_group()
        elif mode == "replace":
            report.update(_replace(index, size, store))
        report["after"] = default_group_problems(world, index, size)
        report["environment"] = (os.environ.get("RANK"), os.environ.get("WORLD_SIZE"))
        results.put((index, report))
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        results.put((index, {"error": traceback.format_exc()}))
