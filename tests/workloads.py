"""Sources, sinks and transport hooks that tests run inside Ray actors and harness processes.

They live in an importable module (the test fixtures put the repository root on ``PYTHONPATH`` before starting
Ray) so that Ray and ``multiprocessing`` can rebuild them by reference in worker processes.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch

from weightsync.core.digest import UpdateDigest
from weightsync.core.tensors import as_byte_view


def model_tensors(version: int, *, tensors: int = 12, numel: int = 50_000) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(version)
    out = []
    for index in range(tensors):
        dtype = (torch.float32, torch.bfloat16, torch.int64)[index % 3]
        data = torch.randint(0, 256, (numel * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8,
                             generator=generator)
        out.append((f"model.layers.{index}.weight", data.view(dtype)))
    return out


def weights_digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    digest = UpdateDigest()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        digest.update_bucket(name.encode(), as_byte_view(tensor))
    return digest.hexdigest()


class _Inspectable:
    """What tests ask a worker process about itself, from outside the engine."""

    def pid(self) -> int:
        return os.getpid()

    def thread_names(self) -> list[str]:
        import threading

        return sorted(thread.name for thread in threading.enumerate())


class ModelSource(_Inspectable):
    """An actor rank's model: deterministic tensors per version; ``set_mode`` injects faults in the stream."""

    def __init__(self, rank: int, world_size: int, *, tensors: int = 12, numel: int = 50_000) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.tensors = tensors
        self.numel = numel
        self.version = 1
        self.mode = "normal"
        self.delay = 0.0

    def set_version(self, version: int) -> str:
        self.version = version
        return weights_digest(model_tensors(version, tensors=self.tensors, numel=self.numel))

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        self.mode = mode
        self.delay = delay

    def named_weights(self) -> Iterator[Any]:
        for index, (name, tensor) in enumerate(model_tensors(self.version, tensors=self.tensors, numel=self.numel)):
            if self.delay:
                time.sleep(self.delay)
            if self.mode == "duplicate" and index == 3:
                yield model_tensors(self.version, tensors=1, numel=self.numel)[0]
                continue
            if self.mode == "non_tensor" and index == 3:
                yield name, [1.0, 2.0, 3.0]
                continue
            if self.mode == "raise_midway" and index == self.tensors // 2:
                raise RuntimeError("the trainer's weight gather failed half-way")
            yield name, tensor


    def pg_constructions(self) -> int:
        return counting_groups()


class RecordingSink(_Inspectable):
    """A rollout worker's model: keeps a copy of every tensor and records the pause/resume hooks it sees."""

    def __init__(self, replica: int, worker: int) -> None:
        torch.set_num_threads(1)
        self.weights: dict[str, torch.Tensor] = {}
        self.hooks: list[str] = []
        self.hook_times: list[tuple[str, float]] = []
        self.version = 0

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        async for name, tensor in weights:
            self.weights[name] = tensor.clone()
        self.version = version

    def digest(self) -> str:
        return weights_digest(list(self.weights.items()))

    def abort_all_requests(self) -> None:
        self._hook("abort_all_requests")

    def release_kv_cache(self) -> None:
        self._hook("release_kv_cache")

    def resume_kv_cache(self) -> None:
        self._hook("resume_kv_cache")

    def resume_generation(self) -> None:
        self._hook("resume_generation")

    def _hook(self, hook: str) -> None:
        self.hooks.append(hook)
        self.hook_times.append((hook, time.monotonic()))  # CLOCK_MONOTONIC: comparable across this host's workers

    def hook_log(self) -> list[str]:
        return list(self.hooks)

    def hook_clock(self) -> list[tuple[str, float]]:
        return list(self.hook_times)


    def pg_constructions(self) -> int:
        return counting_groups()


# -- counting process-group constructions from outside the engine ----------------------------------------------------

_constructions = 0


def counting_groups() -> int:
    """Install (once per process) a wrapper around ``torch.distributed.ProcessGroupGloo``; return constructions."""
    import torch.distributed as dist

    original: Any = dist.ProcessGroupGloo
    if not getattr(original, "_weightsync_counting", False):

        class Counting(original):  # type: ignore[misc]
            _weightsync_counting = True

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                global _constructions
                _constructions += 1
                super().__init__(*args, **kwargs)

        setattr(dist, "ProcessGroupGloo", Counting)
    return _constructions


class CountingModelSource(ModelSource):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        counting_groups()


class CountingSink(RecordingSink):
    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        counting_groups()


# -- transport hooks (engine option transport_hook="tests.workloads:NAME") -------------------------------------------


class _FlipAfterPack:
    """Corrupts a packed bucket on the sender before it is hashed: only a byte comparison can notice."""

    def after_pack(self, index: int, payload: torch.Tensor) -> None:
        if index == 0 and payload.numel():
            payload[0] ^= 0x01


class _FlipAfterReceive:
    """Corrupts every first bucket a receiver gets, after transit and before hashing: the digest must notice."""

    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        if index == 0 and payload.numel():
            # Shared-memory receivers see each other's writes: add (never cancels out), do not XOR.
            payload[payload.numel() // 2] += 1


class _FlipOnce:
    """Like ``_FlipAfterReceive``, but only in the first update this process sees (the next one repairs)."""

    def __init__(self) -> None:
        self.done = False

    def after_receive(self, index: int, payload: torch.Tensor) -> None:
        if not self.done and payload.numel():
            self.done = True
            payload[0] += 1


FLIP_AFTER_PACK = _FlipAfterPack()
FLIP_AFTER_RECEIVE = _FlipAfterReceive()
FLIP_ONCE = _FlipOnce()
