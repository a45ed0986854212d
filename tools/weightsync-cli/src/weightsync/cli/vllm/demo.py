"""``weightsync demo --rollout vllm``: train a Llama on an actor worker group of two ranks and sync every step into
real vLLM engines through weightsync, each checked against a plain vLLM engine that loads the same version from a
checkpoint with vLLM's own ``reload_weights``: vLLM's checksums of every parameter and greedy tokens must match.

With ``--delta`` the steps are taken at an RL learning rate (1e-6) and sent as delta updates; greedy tokens rarely
change then, and the checksums still must match. With ``--staged`` the replicas serve while the update is staged
and pause only for vLLM's load (each step's "paused" is then that swap).
"""

from __future__ import annotations

import asyncio
import pathlib
import statistics
import tempfile
import time
from typing import Any

from weightsync.cli.demo import RL_LR, TRAIN_LR, DemoOptions
from weightsync.cli.vllm.serving import Serving, serving
from weightsync.cli.vllm.workload import PROMPTS, llama_config

__all__ = ["run_vllm_demo"]


async def _greedy(replica: Any) -> list[list[int]]:
    """Each prompt on its own, greedy, 8 tokens."""
    return [list((await replica.generate(prompt, max_tokens=8))["token_ids"]) for prompt in PROMPTS]


async def _step(world: Serving, manager: Any, *, step: int, lr: float, delta: bool, root: pathlib.Path,
                previous: list[list[int]]) -> tuple[bool, list[list[int]], str]:
    """Train, sync, compare with the reference; (all matched, the reference's tokens, the line to print)."""
    *replicas, reference = world.replicas
    await asyncio.gather(*world.actor_wg.call("train", 1, lr))
    report = await manager.update_weights(version=step)
    path = await world.actor_wg.handles[0].call.remote("save", str(root / f"v{step}"))
    await reference.call("reload", path)
    expected_sums, expected_tokens = await reference.vllm_checksums(), await _greedy(reference)
    sums_ok = [await replica.vllm_checksums() == expected_sums for replica in replicas]
    tokens_ok = [await _greedy(replica) == expected_tokens for replica in replicas]
    pauses = [timings["pause_seconds"] for timings in await asyncio.gather(*(r.call("timings") for r in replicas))]
    changed = sum(now != before for now, before in zip(expected_tokens, previous))
    sent = f" sent {report.wire_bytes / 1e6:.1f} MB ({report.changed_fraction:.1%} changed)" if delta else ""
    line = (f"step {step}  version {report.version}  {report.nbytes / 1e6:.1f} MB{sent}  transfer "
            f"{report.transfer_seconds:.2f} s  paused {statistics.median(pauses):.2f} s (p50)  vLLM checksums = "
            f"reference: {sum(sums_ok)}/{len(replicas)}  greedy tokens = reference: {sum(tokens_ok)}/{len(replicas)}"
            f"  ({changed}/{len(PROMPTS)} prompts' tokens changed by the step)")
    return report.ok and all(sums_ok) and all(tokens_ok), expected_tokens, line


async def run_vllm_demo(options: DemoOptions) -> int:
    from weightsync.api.config import MiB, SyncConfig
    from weightsync.api.errors import WeightsyncError
    from weightsync.core.control.manager import CheckpointEngineManager

    started = time.perf_counter()
    config = llama_config(options.model_mb)
    lr = RL_LR if options.delta else TRAIN_LR
    print(f"weightsync demo --rollout vllm: backend {options.backend}, Llama of {config['num_hidden_layers']} "
          f"layer(s) (bf16, fp32 masters, AdamW lr {lr:g}{', delta updates' if options.delta else ''}"
          f"{', staged' if options.staged else ''}), actor_wg of "
          f"2 ranks, {options.replicas} vLLM replicas and a reference engine (starting them takes a minute)",
          flush=True)
    matched = 0
    with tempfile.TemporaryDirectory(prefix="weightsync-demo-vllm-") as tmp:
        root = pathlib.Path(tmp)
        try:
            async with serving(config=config, root=root, replicas=options.replicas, plain=1,
                               address=options.address) as world:
                manager = CheckpointEngineManager(
                    backend=options.backend, actor_wg=world.actor_wg, replicas=world.replicas[:-1],
                    config=SyncConfig(bucket_bytes=options.bucket_mb * MiB, delta=options.delta,
                                      staged=options.staged))
                previous = await _greedy(world.replicas[-1])
                for step in range(1, options.steps + 1):
                    ok, previous, line = await _step(world, manager, step=step, lr=lr, delta=options.delta,
                                                      root=root, previous=previous)
                    matched += ok
                    print(line, flush=True)
        except WeightsyncError as exc:
            print(f"error: {type(exc).__name__}: {exc}", flush=True)
    print(f"({time.perf_counter() - started:.1f} s in all)")
    print(f"{matched}/{options.steps} steps: every replica holds what vLLM loads from that version's checkpoint")
    return 0 if matched == options.steps else 1
