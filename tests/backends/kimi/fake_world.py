"""A fake checkpoint-engine world (threads in one process) that records every call, and helpers that run the
kimi lifecycle against it: ``KimiCheckpointEngine.library`` is the seam."""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch

from weightsync.api.testing import case_tensors, raw_bytes
from weightsync.api.types import TransferReport, WorkerContext, WorldMetadata
from weightsync.kimi.engine import KimiCheckpointEngine
from weightsync.kimi.library import CheckpointEngineLibrary

__all__ = ["FakeWorld", "FakeLibrary", "EXPECTED", "kimi_engines", "run_update", "run_updates"]


class FakeWorld:
    """The shared state of a fake checkpoint-engine world: registered shares, collectives, a call log."""

    def __init__(self, size: int, *, actors: int, corrupt: bool = False) -> None:
        self.size = size
        self.actors = actors
        self.corrupt = corrupt
        self.barrier = threading.Barrier(size, timeout=30)
        self.lock = threading.Lock()
        self.shares: dict[int, dict[str, torch.Tensor]] = {}
        self.calls: list[tuple[int, str, dict[str, Any]]] = []
        self._sums: dict[int, list[int]] = {}
        self._reduce_calls = [0] * size

    def log(self, who: int, method: str, **arguments: Any) -> None:
        with self.lock:
            self.calls.append((who, method, arguments))

    def all_reduce(self, rank: int, values: list[int]) -> list[int]:
        with self.lock:
            self._reduce_calls[rank] += 1
            key = self._reduce_calls[rank]
            total = self._sums.setdefault(key, [0] * len(values))
            self._sums[key] = [a + b for a, b in zip(total, values)]
        self.barrier.wait()
        return list(self._sums[key])

    def buckets(self) -> list[list[tuple[str, torch.Tensor]]]:
        items = [(name, tensor) for rank in sorted(self.shares) for name, tensor in self.shares[rank].items()]
        return [items[start:start + 3] for start in range(0, len(items), 3)]


class FakeParameterServer:
    def __init__(self, world: FakeWorld, **kwargs: Any) -> None:
        self.world = world
        self.rank = int(kwargs["rank"])
        world.log(self.rank, "__init__", **kwargs)

    def init_process_group(self, *, timeout: datetime.timedelta) -> None:
        self.world.log(self.rank, "init_process_group", timeout=timeout)

    def register_checkpoint(self, checkpoint_name: str, *, named_tensors: dict[str, torch.Tensor],
                            use_shared_memory_pool: bool = False) -> None:
        self.world.log(self.rank, "register_checkpoint", name=checkpoint_name, names=sorted(named_tensors),
                       use_shared_memory_pool=use_shared_memory_pool)
        with self.world.lock:
            self.world.shares[self.rank] = {name: tensor.clone() for name, tensor in named_tensors.items()}

    def gather_metas(self, checkpoint_name: str) -> None:
        self.world.log(self.rank, "gather_metas", name=checkpoint_name)
        self.world.barrier.wait()

    def update(self, checkpoint_name: str, req_func: Callable[[list[tuple[str, str]]], None], *,
               timeout: datetime.timedelta, ranks: list[int] | None = None) -> None:
        self.world.log(self.rank, "update", name=checkpoint_name, ranks=ranks)
        if not ranks or self.rank in ranks:
            paths = [(f"GPU-{rank}", f"ipc://fake-{rank}") for rank in range(self.world.size)]
            thread = threading.Thread(target=req_func, args=(paths,))
            thread.start()
            thread.join(30)
        self.world.barrier.wait()

    def unregister_checkpoint(self, checkpoint_name: str, force: bool = False) -> None:
        self.world.log(self.rank, "unregister_checkpoint", name=checkpoint_name, force=force)


class FakeLibrary(CheckpointEngineLibrary):
    """checkpoint-engine replaced by the fake world (threads); GPU ``i`` is PS rank ``i``'s."""

    def __init__(self, world: FakeWorld) -> None:
        super().__init__()
        self.world = world

    def p2p_available(self) -> bool:
        return True

    def new_parameter_server(self, **kwargs: Any) -> FakeParameterServer:
        return FakeParameterServer(self.world, **kwargs)

    def join_group(self, server: Any, *, timeout: datetime.timedelta) -> None:
        server.init_process_group(timeout=timeout)  # the fake world's collectives are its own (threads)

    def device_uuid(self, *, ps_rank: int) -> str:
        return f"GPU-{ps_rank}"

    def all_reduce_sum(self, values: list[int], *, ps_rank: int) -> list[int]:
        return self.world.all_reduce(ps_rank, values)

    def serve_ipc(self, handle: str, run: Callable[[list[tuple[str, torch.Tensor]]], None], *, ps_rank: int) -> None:
        assert handle == f"ipc://fake-{ps_rank}"
        for index, bucket in enumerate(self.world.buckets()):
            buffer = [(name, tensor.clone()) for name, tensor in bucket]
            if self.world.corrupt and ps_rank >= self.world.actors and index == 1:
                buffer[0][1].view(-1).view(torch.uint8)[0] ^= 0xFF
            run(buffer)
            for _, tensor in buffer:
                tensor.fill_(0)  # the IPC buffer is reused after run() returns: a kept view would see this

    def destroy_process_group(self) -> None:
        self.world.log(-1, "destroy_process_group")


def kimi_engines(actors: int, rollouts: int, *, mode: str = "broadcast", corrupt: bool = False
             ) -> tuple[FakeWorld, list[KimiCheckpointEngine]]:
    """Engines of one fake world, through init_process_group."""
    world = FakeWorld(actors + rollouts, actors=actors, corrupt=corrupt)
    contexts = [WorkerContext(role="actor", rank=rank, node_id="n") for rank in range(actors)]
    contexts += [WorkerContext(role="rollout", rank=rank, node_id="n") for rank in range(rollouts)]
    engines = [KimiCheckpointEngine(bucket_bytes=1 << 16, mode=mode, timeout=30, context=context)
               for context in contexts]
    for engine in engines:
        engine.library = FakeLibrary(world)
    metadata = WorldMetadata(actor=[e.prepare() for e in engines[:actors]],
                             rollout=[e.prepare() for e in engines[actors:]])
    topology = KimiCheckpointEngine.build_topology(actor_wg_world_size=actors, rollout_world_size=rollouts,
                                                   metadata=metadata)
    for engine, args in zip(engines, [*topology.actor, *topology.rollout]):
        engine.init_process_group(rank_args=args)
    return world, engines


EXPECTED = {name: raw_bytes(tensor) for name, tensor in case_tensors("mixed", 2, 1 << 16)}


async def receive(engine: KimiCheckpointEngine, *, leave_after: int | None = None
                   ) -> tuple[TransferReport | None, dict[str, bool]]:
    stream = engine.receive_weights()
    same = {}
    async for name, tensor in stream:
        same[name] = bool(torch.equal(raw_bytes(tensor), EXPECTED[name]))
        if leave_after is not None and len(same) >= leave_after:
            await stream.aclose()
            break
    return stream.report, same


def run_update(engines: list[KimiCheckpointEngine], *, leave_after: int | None = None) -> list[Any]:
    """One update on every engine at once (a thread and an event loop each); each result or error, by engine."""
    results: list[Any] = [None] * len(engines)

    def work(index: int, engine: KimiCheckpointEngine) -> None:
        try:
            if engine.context.role == "actor":
                results[index] = asyncio.run(engine.send_weights(case_tensors("mixed", 2, 1 << 16), version=2))
            else:
                results[index] = asyncio.run(receive(engine, leave_after=leave_after))
            engine.finalize()
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=work, args=(index, engine)) for index, engine in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def run_updates(actors: int, rollouts: int, *, mode: str = "broadcast", corrupt: bool = False, updates: int = 1
         ) -> tuple[FakeWorld, list[Any], list[Any]]:
    world, engines = kimi_engines(actors, rollouts, mode=mode, corrupt=corrupt)
    try:
        for _ in range(updates):
            results = run_update(engines)
    finally:
        for engine in engines:
            engine.close()
    return world, results[:actors], results[actors:]
