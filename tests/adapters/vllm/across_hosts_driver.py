"""The driver of test_vllm_across_hosts, run inside the testbed's head host: ``backend="auto"`` into two vLLM
replicas on two other hosts.

Placement (hosts by index): the actor worker group (two ranks) on host 1, replica 0 on host 2, replica 1 on host 3.
Two updates at lr 1e-3; after each, every replica's greedy top-5 logprobs and vLLM's own checksums, and the
checkpoint of that version (for the test's reference engine). Between the two, the test reads the link counters.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import ray

from tests.adapters.vllm.workloads import PROMPTS
from tests.tools.testbed.driving import DriverChannel
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.cli.vllm.serving import bind_env
from weightsync.cli.vllm.workload import LlamaTrainer
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup
from weightsync.vllm import VllmRolloutReplica, engine_args


async def _served(replica: VllmRolloutReplica) -> dict[str, Any]:
    outputs = [await replica.generate(prompt, max_tokens=6, logprobs=5) for prompt in PROMPTS]
    return {"outputs": outputs, "checksums": await replica.vllm_checksums(),
            "version": await replica.call("weight_version")}


async def run(nodes: dict[str, str], root: str, channel: DriverChannel) -> dict[str, Any]:
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=LlamaTrainer, node_id=nodes["1"])
    replicas: list[VllmRolloutReplica] = []
    try:
        start = await actor_wg.handles[0].call.remote("save", f"{root}/v0")
        replicas = list(await asyncio.gather(*[
            VllmRolloutReplica.create(replica=i, args=engine_args(start), env=bind_env(i), node_id=nodes[str(2 + i)])
            for i in range(2)
        ]))
        manager = CheckpointEngineManager(
            backend="auto", actor_wg=actor_wg, replicas=replicas,
            config=SyncConfig(bucket_bytes=256 << 10, timeouts=StepTimeouts(transfer=120, setup=120)))
        steps = []
        for step in range(2):
            if step == 1:
                channel.ask({"mark": "before"})
            await asyncio.gather(*actor_wg.call("train", 1, 1e-3))
            report = await manager.update_weights()
            if step == 1:
                channel.ask({"mark": "after"})
            path = await actor_wg.handles[0].call.remote("save", f"{root}/across{step}")
            steps.append({"path": path, "version": report.version, "nbytes": report.nbytes, "chosen": report.chosen,
                          "states": [outcome.state for outcome in report.replicas],
                          "served": [await _served(replica) for replica in replicas]})
        return {"steps": steps}
    finally:
        for replica in replicas:
            await replica.stop()
        actor_wg.shutdown()


def main() -> None:
    nodes: dict[str, str] = json.loads(sys.argv[1])  # host index -> Ray node id
    channel = DriverChannel()
    ray.init(logging_level="ERROR", log_to_driver=False)
    channel.tell({"result": asyncio.run(run(nodes, sys.argv[2], channel))})


if __name__ == "__main__":
    main()
