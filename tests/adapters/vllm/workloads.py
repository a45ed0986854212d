"""What the vLLM tests train: the CLI's Llama trainer (``weightsync.cli.vllm.workload``) with a faulty sender's
hooks added."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from weightsync.cli.vllm.workload import PROMPTS, LlamaTrainer

__all__ = ["FaultyTrainer", "PROMPTS", "ShardedTrainer"]


class FaultyTrainer(LlamaTrainer):
    """A ``LlamaTrainer`` whose stream a test can break (leave tensors out, fail part-way) or slow down."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.omit: set[str] = set()
        self.fail_after: int | None = None
        self.delay = 0.0

    def set_omit(self, names: list[str]) -> None:
        """Leave these tensors out of every update (a faulty sender whose stream is consistent with its digest)."""
        self.omit = set(names)

    def set_fail_after(self, count: int | None) -> None:
        """Raise from ``named_weights`` after ``count`` tensors (0: before the first), ``None``: never."""
        self.fail_after = count

    def set_delay(self, seconds: float) -> None:
        """Wait this long before each tensor (a slow sender: an update that lasts while the replicas serve)."""
        self.delay = seconds

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, tensor) in enumerate(self.served()):
            time.sleep(self.delay)
            if index == self.fail_after:
                raise RuntimeError(f"the trainer failed after {index} tensors (a test's fault)")
            if name not in self.omit:
                yield name, tensor


class ShardedTrainer(LlamaTrainer):
    """The same Llama (the same fp32 masters at start) under FSDP2 over gloo (``shard``, on every rank at once:
    ``fully_shard`` on each decoder layer and on the model, each rank a ``Shard(0)`` block of every parameter). Its
    stream is its own blocks, cast to bf16 (``weightsync.core.ModuleShards``); ``step`` makes the next version
    without training; ``save`` gathers the model on every rank (call it on all of them) and rank 0 writes it."""

    def shard(self, init_method: str) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world_size)
        mesh = init_device_mesh("cpu", (self.world_size,))
        for layer in self.model.model.layers:  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def step(self, seed: int, scale: float = 0.05) -> None:
        """Add the same full-shape noise (from ``seed``) to the model on every rank, each to its own block."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, parameter in self.model.named_parameters():
                local, start = _local(parameter)
                noise = torch.randn(tuple(parameter.shape), generator=generator) * scale
                local.add_(noise[tuple(slice(at, at + size) for at, size in zip(start, local.shape))])

    def named_weights(self) -> Iterator[tuple[str, Any]]:
        from weightsync.core import ModuleShards

        return iter(ModuleShards(self.model, dtype=torch.bfloat16).named_weights())

    def source_layout(self) -> Any:
        from weightsync.core import ModuleShards

        return ModuleShards(self.model).source_layout()

    def save(self, directory: str) -> str:
        from weightsync.cli.vllm.workload import write_checkpoint

        full = {name: parameter.full_tensor().to(torch.bfloat16)  # type: ignore[attr-defined]
                for name, parameter in self.model.named_parameters()}
        path = pathlib.Path(directory)
        return str(write_checkpoint(path, full, self.config)) if self.rank == 0 else str(path)


def _local(parameter: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A ``DTensor`` parameter's local block and where it starts."""
    chunk = parameter.__create_chunk_list__()[0]  # type: ignore[attr-defined]
    return parameter.to_local(), tuple(chunk.offsets)  # type: ignore[attr-defined]
