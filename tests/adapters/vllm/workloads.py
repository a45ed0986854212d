"""What the vLLM tests train: the CLI's Llama trainer (``weightsync.cli.vllm.workload``) with a faulty sender's
hooks added."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from weightsync.cli.vllm.workload import PROMPTS, LlamaTrainer

__all__ = ["FaultyTrainer", "PROMPTS"]


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
