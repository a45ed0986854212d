"""Replicas of several vLLM workers (``tensor_parallel_size=2``): every vLLM worker is a rollout worker of its
replica, declares the part of the checkpoint its own loaders keep (recorded once, ``weightsync.vllm.parts``), and
reads and verifies only that part of each update, while vLLM loads through its own loaders as at TP 1. Each update
is checked against a TP-2 reference engine that loads the same version from its checkpoint (greedy tokens, top-5
logprobs, vLLM's checksums of every parameter of every worker). The host has two rails for these engines: worker i
takes rail i, from vLLM's local rank.

Runs last (its name): it stops the session's TP-1 engines before starting its own (``Serving.stop``)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in the vllm env: python3 -m hatch run vllm:test")

import ray  # noqa: E402

from tests.adapters.vllm.conftest import Serving  # noqa: E402
from tests.adapters.vllm.workloads import PROMPTS, ShardedTrainer  # noqa: E402
from weightsync.api import SyncConfig  # noqa: E402
from weightsync.api.errors import TopologyError  # noqa: E402
from weightsync.api.types import UpdateReport  # noqa: E402
from weightsync.core import CheckpointEngineManager  # noqa: E402
from weightsync.core.control import parts as control_parts  # noqa: E402
from weightsync.core.control import setup as control_setup  # noqa: E402
from weightsync.core.transports.place import RAIL_ADDRS_ENV  # noqa: E402
from weightsync.core.worker.host import engine_spec  # noqa: E402
from weightsync.ray import RayActorWorkerGroup  # noqa: E402
from weightsync.vllm import VllmRolloutReplica  # noqa: E402

TP = 2


@dataclass
class Fleet:
    serving: Serving
    replicas: list[VllmRolloutReplica]
    reference: VllmRolloutReplica

    def run(self, awaitable: Any) -> Any:
        return self.serving.loop.run_until_complete(awaitable)

    def manager(self, **config: Any) -> CheckpointEngineManager:
        return CheckpointEngineManager(backend="shm", actor_wg=self.serving.actor_wg, replicas=self.replicas,
                                       config=SyncConfig(bucket_bytes=config.pop("bucket_bytes", 256 << 10),
                                                         **config))

    def version(self, name: str, *, lr: float = 1e-3) -> str:
        ray.get(self.serving.actor_wg.call("train", 1, lr))
        return str(ray.get(self.serving.actor_wg.handles[0].call.remote("save", str(self.serving.checkpoints / name))))

    def generate(self, replica: VllmRolloutReplica) -> list[dict[str, Any]]:
        return [ray.get(replica.generate(prompt, max_tokens=6, logprobs=5)) for prompt in PROMPTS]

    def assert_same_as_reference(self, path: str) -> None:
        self.run(self.reference.call("reload", path))
        expected, sums = self.generate(self.reference), self.run(self.reference.vllm_checksums())
        assert len(sums) > 0 and all(key.startswith(("worker0/", "worker1/")) for key in sums)
        for replica in self.replicas:
            mine = self.generate(replica)
            assert [o["token_ids"] for o in mine] == [o["token_ids"] for o in expected], replica.name
            assert [o["logprobs"] for o in mine] == [o["logprobs"] for o in expected], replica.name
            assert self.run(replica.vllm_checksums()) == sums, replica.name


RAILS = ("127.0.0.1", "127.0.0.2")
"""Two rails on this host for the module's engines (loopback addresses: every test's transfers cross them)."""


@pytest.fixture(scope="module")
def fleet(serving: Serving) -> Iterator[Fleet]:
    serving.stop()  # the session's TP-1 engines: never alive together with these
    made = serving.start_engines(2, weightsync=1, tensor_parallel_size=TP, env={RAIL_ADDRS_ENV: ",".join(RAILS)})
    try:
        yield Fleet(serving, made[:1], made[1])
    finally:
        serving.stop_engines(made)


def model_bytes(fleet: Fleet) -> int:
    return int(ray.get(fleet.serving.actor_wg.handles[0].call.remote("nbytes")))


def check_parts(report: UpdateReport, model: int) -> None:
    """Every worker verified its part: two distinct parts, one per TP rank, each about half the model."""
    receivers = [transfer for transfer in report.transfers if transfer.role == "rollout"]
    assert sorted(transfer.part for transfer in receivers) == [0, 1], receivers
    for transfer in receivers:
        assert 0.45 * model < transfer.part_bytes <= 0.52 * model + 4096, (transfer.part_bytes, model)


@pytest.mark.parametrize("mode", ["full", "delta", "staged"])
def test_a_tp2_replica_takes_updates_and_matches_a_tp2_reference(fleet: Fleet, mode: str) -> None:
    manager = fleet.manager(delta=mode == "delta", staged=mode == "staged")
    first = fleet.run(manager.update_weights())
    assert first.ok, first.replicas
    if mode != "delta":
        check_parts(first, model_bytes(fleet))
    path = fleet.version(f"tp2_{mode}", lr=1e-6 if mode == "delta" else 1e-3)
    report = fleet.run(manager.update_weights())
    assert report.ok, report.replicas
    assert [o.received for o in report.replicas] == ["changes" if mode == "delta" else "full"]
    fleet.assert_same_as_reference(path)
    sums = fleet.run(fleet.replicas[0].weight_checksums())
    assert {key.split("/")[0] for key in sums} == {"worker0", "worker1"}  # the proof of load, by worker
    assert set(fleet.run(fleet.replicas[0].call("internals"))) == {"actor", "worker0", "worker1"}  # each process


def test_each_vllm_worker_takes_the_rail_of_its_local_rank(fleet: Fleet) -> None:
    """Worker i of a TP-2 replica is on rail i, as a GPU node maps a GPU to its NIC: what the replica's actor answers
    for it when pinged, and what its own vLLM process advertises when prepared. vLLM's multiprocessing executor sets
    no ``LOCAL_RANK``: without weightsync setting it from vLLM's local rank both would say rail 0."""
    workers = fleet.replicas[0].workers
    spec = engine_spec(backend="shm", config=SyncConfig(bucket_bytes=256 << 10), role="rollout", rank=1)

    async def each(method: str, **kwargs: Any) -> list[Any]:  # every worker at once: the actor meets their calls
        return list(await asyncio.gather(*(worker.execute_checkpoint_engine(method, **kwargs) for worker in workers)))

    pings, prepared = fleet.run(each("ping")), fleet.run(each("prepare", engine=spec))
    for answers in (pings, prepared):
        assert [(answer["rail"], answer["rail_address"], answer["rails"]) for answer in answers] == \
            [(0, RAILS[0], 2), (1, RAILS[1], 2)], answers


def test_a_worker_planned_for_another_part_is_refused_before_any_pause(fleet: Fleet,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A test hook swaps the parts the manager hands the replica's two workers: each worker finds its plan is not
    for the part it declared, and the update fails naming it before the replica is paused."""
    declared = control_parts.declared_parts

    def swapped(rollout: Any, labels: Any) -> Any:
        parts = declared(rollout, labels)
        parts[0], parts[1] = parts[1], parts[0]
        return parts

    monkeypatch.setattr(control_setup, "declared_parts", swapped)
    manager = fleet.manager()
    before = [fleet.run(replica.call("pause_log")) for replica in fleet.replicas]
    with pytest.raises(TopologyError, match="replica0/worker"):
        fleet.run(manager.update_weights())
    assert [fleet.run(replica.call("pause_log")) for replica in fleet.replicas] == before


def test_a_tp2_update_that_fails_part_way_tears_both_workers_and_the_next_repairs(fleet: Fleet) -> None:
    """The sender fails after 12 tensors, buckets of 40 KiB (a fused layer's parts in several buckets): both
    workers of the replica are torn, the replica stays paused; the next update commits it, equal to the
    reference."""
    manager = fleet.manager(bucket_bytes=40 << 10)
    fleet.run(manager.update_weights())
    ray.get(fleet.serving.actor_wg.call("set_fail_after", 12))
    try:
        fleet.version("tp2_failing")
        with pytest.raises(Exception):
            fleet.run(manager.update_weights())
        assert [o.state for o in manager.status()] == ["torn"]
        assert all(fleet.run(replica.call("is_paused")) for replica in fleet.replicas)
    finally:
        ray.get(fleet.serving.actor_wg.call("set_fail_after", None))
    path = str(ray.get(fleet.serving.actor_wg.handles[0].call.remote(
        "save", str(fleet.serving.checkpoints / "tp2_after"))))
    report = fleet.run(manager.update_weights())
    assert report.ok and not any(fleet.run(replica.call("is_paused")) for replica in fleet.replicas)
    fleet.assert_same_as_reference(path)


def test_a_tp2_replica_takes_updates_from_an_fsdp2_sharded_actor_wg(fleet: Fleet) -> None:
    """Two actor ranks hold the Llama under FSDP2 (each a ``Shard(0)`` block of every parameter) and each sends only
    its blocks, at once; each vLLM worker reads both ranks' streams, keeps and verifies its part, and vLLM loads it:
    equal to the TP-2 reference loading the same version from a checkpoint. Nothing is gathered to send."""
    sharded = RayActorWorkerGroup.create(world_size=2, source_factory=ShardedTrainer,
                                         node_id=ray.get_runtime_context().get_node_id())
    try:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ray.get(sharded.call("shard", f"tcp://127.0.0.1:{port}"))
        manager = CheckpointEngineManager(backend="shm", actor_wg=sharded, replicas=fleet.replicas,
                                          config=SyncConfig(bucket_bytes=256 << 10))
        model = model_bytes(fleet)
        for seed in (11, 12):
            ray.get(sharded.call("step", seed))
            path = ray.get(sharded.call("save", str(fleet.serving.checkpoints / f"tp2_sharded_{seed}")))[0]
            report = fleet.run(manager.update_weights())
            assert report.ok, report.replicas
            sent = sorted(transfer.nbytes for transfer in report.transfers if transfer.role == "actor")
            assert len(sent) == 2 and sum(sent) == model and sent[0] > 0.45 * model, sent  # each its half
            check_parts(report, model)
            fleet.assert_same_as_reference(path)
    finally:
        sharded.shutdown()
