"""What the verl tests run inside Ray actors: a toy actor worker, a recording server adapter, a replica stand-in.

As on a GPU cluster, the actor's weights live on the accelerator and the rollout loads them into parameters there:
here the emulated accelerator (``tests.devices``), registered in each worker process.

Importable by reference (``tests.adapters.verl.workloads``; tests/conftest.py puts the repository root on
``PYTHONPATH`` before Ray starts) so that Ray can rebuild these objects in worker processes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register

from weightsync.verl import WeightsyncActorMixin

BUCKET_MEGABYTES = 1
BUCKET_BYTES = BUCKET_MEGABYTES << 20

RawTensor = tuple[str, tuple[int, ...], bytes]
"""A received tensor as dtype name, shape and its raw bytes."""

# name, dtype, numel: one tensor three buckets long (split and merged back), odd sizes, several dtypes.
_LAYOUT: list[tuple[str, torch.dtype, int]] = [
    ("embed.weight", torch.bfloat16, 1_600_003),
    ("layers.0.attn.weight", torch.float32, 65_536),
    ("layers.0.attn.bias", torch.float32, 1_001),
    ("layers.0.mlp.weight", torch.float16, 200_000),
    ("layers.0.norm.weight", torch.bfloat16, 777),
    ("layers.1.attn.weight", torch.float32, 65_536),
    ("layers.1.mlp.weight", torch.float16, 200_000),
    ("layers.1.norm.steps", torch.int64, 3),
    ("lm_head.mask", torch.uint8, 4_097),
    ("lm_head.weight", torch.bfloat16, 300_000),
]


STEPPED = 1_000
"""Versions from here on are one model stepped: version ``STEPPED + k`` is version ``STEPPED``'s bytes with a few
of every tensor's changed per step, as between two RL steps (what a delta update sends)."""


def model_weights(version: int) -> list[tuple[str, torch.Tensor]]:
    """The actor's model at ``version``: random bytes (NaN patterns included), so only a byte comparison is exact;
    from ``STEPPED`` on, each version changes 8 bytes of every tensor of the one before."""
    generator = torch.Generator().manual_seed(10_000 + min(version, STEPPED))
    weights = []
    for name, dtype, numel in _LAYOUT:
        size = numel * torch.empty(0, dtype=dtype).element_size()
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        for step in range(1, version - STEPPED + 1):
            data[(step * 7919) % (size - 8):][:8] += step
        weights.append((name, data.view(dtype)))
    return weights


def raw(tensor: torch.Tensor) -> RawTensor:
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), bytes(flat.numpy().tobytes())


def mismatches(received: dict[str, RawTensor], expected: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Every way ``received`` differs from ``expected`` (names, dtypes, shapes, raw bytes); empty when bit-exact."""
    problems = []
    wanted = {name: raw(tensor) for name, tensor in expected}
    for name in sorted(set(wanted) - set(received)):
        problems.append(f"{name}: missing")
    for name in sorted(set(received) - set(wanted)):
        problems.append(f"{name}: unexpected")
    for name in sorted(set(wanted) & set(received)):
        (dtype, shape, data), (got_dtype, got_shape, got_data) = wanted[name], received[name]
        if (dtype, shape) != (got_dtype, got_shape):
            problems.append(f"{name}: {got_dtype}{list(got_shape)} instead of {dtype}{list(shape)}")
        elif data != got_data:
            first = next(index for index, (a, b) in enumerate(zip(data, got_data)) if a != b) if len(data) == len(
                got_data) else -1
            problems.append(f"{name}: bytes differ (first at {first})")
    return problems


class ToyActorWorker(WeightsyncActorMixin, Worker):  # type: ignore[misc]  # verl's Worker is untyped
    """An actor rank whose "model" is ``model_weights(version)``; ``delay`` slows its weights stream."""

    def __init__(self, checkpoint_config: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.set_num_threads(1)
        self.version = 0
        self.delay = 0.0
        from tests.devices import emulated_device

        self.device = emulated_device()
        self.init_checkpoint_engine(checkpoint_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]  # verl is untyped
    def set_model(self, version: int, delay: float = 0.0) -> None:
        self.version = version
        self.delay = delay

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in model_weights(self.version):
            if self.delay:
                time.sleep(self.delay)  # gathering a real sharded model takes time too
            yield name, tensor.to(self.device)


class ShardedToyActor(ToyActorWorker):
    """An actor rank of a sharded trainer: ``model_weights(version)``'s tensors as the parameters of a module under
    FSDP2 over gloo (verl's process-group environment: ``fully_shard`` on the model, each rank a ``Shard(0)`` block
    of every tensor, uneven where the sizes are odd), exported as verl's engines export shards
    (``get_per_tensor_param_shard``: ``(name, local shard, ShardSpec.from_param(p))``)."""

    def __init__(self, checkpoint_config: Any, **kwargs: Any) -> None:
        super().__init__(checkpoint_config, **kwargs)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # verl's worker group set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        module = torch.nn.Module()
        for name, dtype, numel in _LAYOUT:
            owner = module
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(numel, dtype=dtype), requires_grad=False))
        fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        self.module = module

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[untyped-decorator]  # verl is untyped
    def set_model(self, version: int, delay: float = 0.0) -> None:
        full = dict(model_weights(version))
        with torch.no_grad():
            for name, parameter in self.module.named_parameters():
                local = parameter.to_local()  # type: ignore[attr-defined]
                start = parameter.__create_chunk_list__()[0].offsets[0]  # type: ignore[attr-defined]
                local.copy_(full[name][start:start + local.numel()])
        self.version = version

    def weight_shards(self) -> Iterator[tuple[str, torch.Tensor, Any]]:
        from verl.workers.engine.spec import ShardSpec

        for name, parameter in self.module.named_parameters():
            yield name, parameter.to_local(), ShardSpec.from_param(parameter)  # type: ignore[attr-defined]


class RecordingServerAdapter:
    """Stands in for verl's vLLM/SGLang server adapter inside ``CheckpointEngineWorker``: records what it receives.

    ``fail_after = n`` makes the next update raise after ``n`` tensors (then it is cleared).
    """

    def __init__(self, replica_rank: int) -> None:
        self.replica_rank = replica_rank
        self.is_leader_rank = True
        self.received: dict[str, RawTensor] = {}
        self.updates: list[dict[str, Any]] = []
        self.fail_after: int | None = None

    async def update_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], **kwargs: Any) -> None:
        received: dict[str, RawTensor] = {}
        fail_after, self.fail_after = self.fail_after, None
        if fail_after is None:  # as an inference engine does: loaded in place into its parameters on the device
            from weightsync.api.protocols import load_into

            from tests.devices import emulated_device

            device = emulated_device()
            parameters = {name: torch.nn.Parameter(torch.zeros(numel, dtype=dtype, device=device),
                                                   requires_grad=dtype.is_floating_point)
                          for name, dtype, numel in _LAYOUT}
            await load_into(weights, parameters)
            received = {name: raw(parameter) for name, parameter in parameters.items()}
        else:
            async for name, tensor in weights:
                if len(received) >= fail_after:
                    raise RuntimeError(f"injected server-adapter failure after {fail_after} tensors")
                received[name] = raw(tensor)  # a copy: the tensor is a view into the engine's bucket
        self.received = received
        self.updates.append(dict(kwargs))


def snapshot(worker: Any) -> tuple[dict[str, RawTensor], list[dict[str, Any]]]:
    """Run in a ``CheckpointEngineWorker`` through Ray's ``__ray_call__``: what its server adapter recorded."""
    adapter: RecordingServerAdapter = worker.server_adapter
    return adapter.received, adapter.updates


def fail_next_update(worker: Any, after: int) -> None:
    worker.server_adapter.fail_after = after


class ToyReplica:
    """verl's ``RolloutReplica`` as the managers see it: ``workers`` and the coroutine hooks (recorded here)."""

    def __init__(self, replica_rank: int, workers: list[Any]) -> None:
        self.replica_rank = replica_rank
        self.workers = list(workers)
        self.hooks: list[str] = []

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.hooks.append("abort_all_requests(reject)" if reject_request else "abort_all_requests")

    async def release_kv_cache(self) -> None:
        self.hooks.append("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        self.hooks.append("resume_kv_cache")

    async def resume_generation(self) -> None:
        self.hooks.append("resume_generation")

    async def sleep(self) -> None:
        self.hooks.append("sleep")

    async def wake_up(self) -> None:
        self.hooks.append("wake_up")

    async def clear_kv_cache(self) -> None:
        self.hooks.append("clear_kv_cache")
