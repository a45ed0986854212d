"""``weightsync bench``: throughput of each backend, one sender process and R receiver processes on this machine.

The sender holds a bf16 model of S bytes (the ``realistic`` mix: a few large matrices, many small vectors, one
tensor larger than a bucket; or ``small``: 4 KiB tensors). Each receiver copies every received tensor into its own
pre-faulted copy of the model, as an inference engine's ``load_weights`` does. An update's time runs from the
driver's "go" to the last receiver's "done"; figures are GB/s per receiver (S / time, decimal GB), after a warm-up.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import multiprocessing.connection
import secrets
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from weightsync.api.config import MiB
from weightsync.api.registry import available_backends, load_engine_class
from weightsync.api.types import Role, WorkerContext, WorldMetadata
from weightsync.core.engine import default_node_id

__all__ = ["BenchOptions", "BenchResult", "run_bench", "model_layout"]


@dataclass(frozen=True)
class BenchOptions:
    backends: tuple[str, ...] = ()
    model_mb: float = 1024.0
    receivers: int = 2
    bucket_mb: int = 64
    mix: str = "realistic"
    repeat: int = 5
    json_path: str | None = None


@dataclass(frozen=True)
class BenchResult:
    backend: str
    gbps_p50: float
    gbps_p90: float
    seconds: list[float]


def model_layout(total_bytes: int, bucket_bytes: int, mix: str) -> list[tuple[str, tuple[int, ...]]]:
    """Names and bf16 shapes adding up to about ``total_bytes``."""
    if mix == "small":
        count = max(1, total_bytes // 4096)
        return [(f"layers.{i}.bias", (2048,)) for i in range(count)]
    elements = total_bytes // 2
    shapes: list[tuple[str, tuple[int, ...]]] = [("lm_head.weight", (int(1.5 * bucket_bytes) // 2,))]
    remaining = elements - shapes[0][1][0]
    for i in range(200):
        shapes.append((f"model.layers.{i}.input_layernorm.weight", (2048,)))
    remaining -= 200 * 2048
    layer = 0
    while remaining > 0:
        numel = min(remaining, 4096 * 4096)
        shapes.append((f"model.layers.{layer}.mlp.up_proj.weight", (numel,)))
        remaining -= numel
        layer += 1
    return shapes


def _worker(conn: multiprocessing.connection.Connection, backend: str, role: Role, rank: int,
            bucket_bytes: int, layout: list[tuple[str, tuple[int, ...]]], node_id: str) -> None:
    torch.set_num_threads(1)
    engine: Any = load_engine_class(backend)(
        bucket_bytes=bucket_bytes, context=WorkerContext(role=role, rank=rank, node_id=node_id)
    )
    tensors = {name: torch.ones(shape, dtype=torch.bfloat16) for name, shape in layout}  # touched: pre-faulted

    async def receive() -> None:
        async for name, tensor in engine.receive_weights():
            tensors[name].copy_(tensor)

    while True:
        command = json.loads(conn.recv_bytes())
        op = command["op"]
        reply: Any = None
        if op == "prepare":
            reply = engine.prepare()
        elif op == "init":
            engine.init_process_group(rank_args=command["rank_args"])
        elif op == "run":
            if role == "actor":
                asyncio.run(engine.send_weights(tensors.items()))
            else:
                asyncio.run(receive())
            engine.finalize()
        elif op == "close":
            engine.close()
            conn.send_bytes(b"null")
            return
        conn.send_bytes(json.dumps(reply).encode())


def _bench_backend(backend: str, options: BenchOptions, progress: Any) -> BenchResult:
    bucket_bytes = options.bucket_mb * MiB
    layout = model_layout(int(options.model_mb * MiB), bucket_bytes, options.mix)
    total = sum(2 * _numel(shape) for _, shape in layout)
    context = multiprocessing.get_context("spawn")
    roles: list[tuple[Role, int]] = [("actor", 0), *(("rollout", rank) for rank in range(options.receivers))]
    pipes = []
    processes = []
    for role, rank in roles:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, daemon=True,
                                  args=(child, backend, role, rank, bucket_bytes, layout, default_node_id()))
        process.start()
        pipes.append(parent)
        processes.append(process)

    def all_do(commands: list[dict[str, Any]]) -> list[Any]:
        for pipe, command in zip(pipes, commands):
            pipe.send_bytes(json.dumps(command).encode())
        return [json.loads(pipe.recv_bytes()) for pipe in pipes]

    try:
        metadata = all_do([{"op": "prepare"}] * len(pipes))
        topology = load_engine_class(backend).build_topology(
            actor_wg_world_size=1, rollout_world_size=options.receivers,
            metadata=WorldMetadata(actor=metadata[:1], rollout=metadata[1:]),
        )
        epoch = secrets.token_hex(16)
        all_do([{"op": "init", "rank_args": {"epoch": epoch, **args}}
                for args in [*topology.actor, *topology.rollout]])
        all_do([{"op": "run"}] * len(pipes))  # warm-up
        seconds = []
        for index in range(options.repeat):
            started = time.perf_counter()
            all_do([{"op": "run"}] * len(pipes))
            seconds.append(time.perf_counter() - started)
            progress(backend, index + 1, options.repeat)
        all_do([{"op": "close"}] * len(pipes))
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    rates = sorted(total / s / 1e9 for s in seconds)
    p90 = rates[max(0, int(round(0.1 * (len(rates) - 1))))]  # 90% of runs were at least this fast
    return BenchResult(backend=backend, gbps_p50=statistics.median(rates), gbps_p90=p90, seconds=seconds)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def run_bench(options: BenchOptions) -> int:
    import sys

    backends = options.backends or tuple(available_backends())

    def progress(backend: str, done: int, total: int) -> None:
        sys.stderr.write(f"\r{backend}: [{'#' * done}{'.' * (total - done)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    results = [_bench_backend(backend, options, progress) for backend in backends]
    print(f"model {options.model_mb:g} MiB ({options.mix}), {options.receivers} receivers, "
          f"buckets {options.bucket_mb} MiB, {options.repeat} runs after a warm-up")
    print(f"{'backend':<10} {'GB/s/recv p50':>14} {'p90':>8}")
    for result in results:
        print(f"{result.backend:<10} {result.gbps_p50:>14.2f} {result.gbps_p90:>8.2f}")
    if options.json_path:
        with open(options.json_path, "w") as handle:
            json.dump({"scenario": {k: v for k, v in asdict(options).items() if k != "json_path"},
                       "results": [asdict(result) for result in results]}, handle, indent=2)
    return 0
