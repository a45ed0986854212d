"""What one ``weightsync bench`` run measures: its options, the model's layout, and the cases it times."""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightsync.api.config import MiB
from weightsync.cli.bench.worker import Layout

__all__ = ["BASELINES", "BenchOptions", "Case", "make_case", "model_bytes", "model_layout"]

BASELINES = ("naive", "bucketed")
SMALL_TENSOR_BYTES = 4096
SMALL_DEFAULT_TENSORS = 10_000


@dataclass(frozen=True)
class BenchOptions:
    backends: tuple[str, ...] = ()
    model_mb: float | None = None
    """None: 1024 MiB for ``realistic``, 10,000 tensors of 4 KiB (39 MiB) for ``small``."""
    receivers: int = 2
    bucket_mb: int = 64
    mix: str = "realistic"
    repeat: int = 5
    json_path: str | None = None
    plot_path: str | None = None
    trace_path: str | None = None
    ray: bool = True
    """Also measure the Ray end-to-end update against a gathered no-op (``--no-ray`` turns it off)."""
    ray_backend: str | None = None
    """Backend of the Ray end-to-end update; None: shm where it can run, else the first measured backend."""


@dataclass
class Case:
    """One set of spawned processes: a backend or baseline, its model and buckets, R receivers, timed updates."""

    name: str
    total_bytes: int
    layout: Layout
    bucket_bytes: int
    receivers: int
    repeat: int


def model_bytes(options: BenchOptions) -> int:
    if options.model_mb is not None:
        return int(options.model_mb * MiB)
    return SMALL_DEFAULT_TENSORS * SMALL_TENSOR_BYTES if options.mix == "small" else 1024 * MiB


def model_layout(total_bytes: int, bucket_bytes: int, mix: str) -> Layout:
    """Names and bf16 shapes adding up to about ``total_bytes``."""
    if mix == "small":
        count = max(1, total_bytes // SMALL_TENSOR_BYTES)
        return [(f"layers.{i}.bias", (SMALL_TENSOR_BYTES // 2,)) for i in range(count)]
    elements = total_bytes // 2
    # One tensor larger than a bucket (split across buckets), many small vectors, large matrices for the rest.
    shapes: Layout = [("lm_head.weight", (min(elements, int(1.5 * bucket_bytes) // 2),))]
    remaining = elements - shapes[0][1][0]
    for i in range(200):
        if remaining < 2048:
            break
        shapes.append((f"model.layers.{i}.input_layernorm.weight", (2048,)))
        remaining -= 2048
    layer = 0
    while remaining > 0:
        numel = min(remaining, 4096 * 4096)
        shapes.append((f"model.layers.{layer}.mlp.up_proj.weight", (numel,)))
        remaining -= numel
        layer += 1
    return shapes


def make_case(name: str, options: BenchOptions, receivers: int | None = None, bucket_mb: int | None = None,
              total_bytes: int | None = None, repeat: int | None = None) -> Case:
    """The case ``name`` as ``options`` describe it, each given argument overriding its option."""
    bucket_bytes = (bucket_mb or options.bucket_mb) * MiB
    layout = model_layout(total_bytes or model_bytes(options), bucket_bytes, options.mix)
    return Case(name=name, total_bytes=sum(2 * math.prod(shape) for _, shape in layout), layout=layout,
                bucket_bytes=bucket_bytes, receivers=receivers or options.receivers, repeat=repeat or options.repeat)
