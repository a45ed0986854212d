"""``weightsync demo``: train a small LM on an actor worker group, sync it into rollout replicas, check bit-exactness.

Everything is real: Ray actors in separate processes, a data-parallel trainer (two ranks whose gradients are
all-reduced over their own gloo default group — the group our gloo backend must coexist with), an AdamW step per
iteration, ``CheckpointEngineManager.update_weights`` with the chosen backend, and forward passes on every replica
whose logits are compared byte for byte with the trainer's.

With ``--delta`` the demo runs as RL post-training does: float32 master weights, an RL learning rate (1e-6), and
rollout weights in bfloat16 (the actor ranks send the masters cast to bf16, and the trainer's logits come from that
cast). Most bf16 bits then survive a step, so after the first update only the changed bytes cross.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from weightsync.api.config import MiB, SyncConfig
from weightsync.api.errors import WeightsyncError
from weightsync.api.protocols import load_into
from weightsync.api.types import UpdateReport
from weightsync.cli.model import (
    LlamaConfig, TinyLlama, config_for_megabytes, tensor_parallel_dims, tensor_parallel_part,
)
from weightsync.cli.progress import Progress
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.tensors import as_byte_view, memoryview_of

__all__ = ["DemoOptions", "DemoTrainer", "DemoRolloutModel", "free_port", "run_demo"]

PROMPT = [[(7 * i + 3 * j) % 251 + 1 for j in range(24)] for i in range(2)]
TRAIN_LR = 1e-3
RL_LR = 1e-6
"""``--delta``: an RL step's learning rate, below half the bf16 spacing of most weights."""


def _weights_digest(model: torch.nn.Module) -> str:
    digest = UpdateDigest()
    for name, parameter in model.named_parameters():
        digest.update_bucket(name.encode(), as_byte_view(parameter))
    return digest.hexdigest()


def _logits_bytes(model: torch.nn.Module, prompt: list[list[int]]) -> bytes:
    with torch.no_grad():
        logits = model(torch.tensor(prompt, dtype=torch.long))
    return bytes(memoryview_of(as_byte_view(logits)))


class DemoTrainer:
    """One data-parallel rank of the trainer: the ``WeightSource`` of an actor rank."""

    def __init__(self, rank: int, world_size: int, *, config: LlamaConfig, lr: float = TRAIN_LR,
                 served: torch.dtype = torch.float32) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.model = TinyLlama(config, seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.served = served
        """The dtype the rollout replicas hold: the float32 masters are cast to it to be sent."""

    def address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def join(self, init_method: str) -> None:
        """The trainer's own default process group (data parallel), as in FSDP."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world_size)

    def train_step(self, step: int) -> str:
        generator = torch.Generator().manual_seed(step * 1000 + self.rank)
        tokens = torch.randint(0, self.model.config.vocab_size, (4, 33), generator=generator)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad()
        torch.autograd.backward(loss)
        if dist.is_initialized():
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad)
                    parameter.grad /= self.world_size
        self.optimizer.step()
        return _weights_digest(self.model)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(self.served)

    def logits(self, prompt: list[list[int]]) -> bytes:
        """The logits of the weights as sent (the masters themselves, or their cast)."""
        if self.served == torch.float32:
            return _logits_bytes(self.model, prompt)
        return _logits_bytes(copy.deepcopy(self.model).to(self.served), prompt)


class DemoShard:
    """One tensor-parallel rollout worker: it holds its part of every layer (``tensor_parallel_part``: half of each
    split parameter at ``--tp 2``, the norms whole), taken from the update's views as an inference engine's loader
    takes its slice. The demo assembles a replica's shards on the driver to check its logits."""

    def __init__(self, replica: int, worker: int, *, config: LlamaConfig, tp: int) -> None:
        torch.set_num_threads(1)
        self.part = tensor_parallel_part(config, worker, tp)
        self.held: dict[str, torch.Tensor] = {}
        self.serving = True

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        async for name, tensor in weights:
            regions = self.part.regions(name)
            if regions is None:
                self.held[name] = tensor.clone()
                continue
            (region,) = regions
            self.held[name] = tensor[region.slices()].clone()

    def shard(self) -> dict[str, torch.Tensor]:
        return dict(self.held)

    def abort_all_requests(self) -> None:
        self.serving = False

    def resume_generation(self) -> None:
        self.serving = True


def assembled_logits(shards: list[dict[str, torch.Tensor]], config: LlamaConfig, prompt: list[list[int]]) -> bytes:
    """The logits of the model a tensor-parallel replica's workers hold together (each its ``shard``)."""
    model = TinyLlama(config, seed=0).to(next(iter(shards[0].values())).dtype)
    dims = tensor_parallel_dims({name: tuple(tensor.shape) for name, tensor in model.named_parameters()})
    whole = {name: torch.cat([shard[name] for shard in shards], dim) for name, dim in dims.items()}
    model.load_state_dict({**shards[0], **whole})
    return _logits_bytes(model, prompt)


class DemoRolloutModel:
    """One rollout worker's inference model: the ``WeightSink`` (and pause hooks) of a rollout worker."""

    def __init__(self, replica: int, worker: int, *, config: LlamaConfig, dtype: torch.dtype = torch.float32
                 ) -> None:
        torch.set_num_threads(1)
        self.model = TinyLlama(config, seed=1000 + replica).to(dtype)  # replicas start from different weights
        self.parameters = dict(self.model.named_parameters())
        self.version = 0
        self.serving = True

    async def load_weights(self, weights: AsyncIterator[tuple[str, torch.Tensor]], *, version: int) -> None:
        with torch.no_grad():
            # Straight from the engine's receive buffers into the parameters; a name the model lacks, or a shape or
            # dtype that differs, raises DestinationError before anything of that tensor is written.
            await load_into(weights, self.parameters)
        self.version = version

    def logits(self, prompt: list[list[int]]) -> bytes:
        return _logits_bytes(self.model, prompt)

    def abort_all_requests(self) -> None:
        self.serving = False

    def resume_generation(self) -> None:
        self.serving = True

    def is_serving(self) -> bool:
        return self.serving


@dataclass(frozen=True)
class DemoOptions:
    """``weightsync demo`` (the flags of the same names)."""

    backend: str = "shm"
    """A backend's registered name, or ``auto``."""
    steps: int = 3
    """Training steps, each followed by an update checked against the trainer's logits."""
    replicas: int = 2
    model_mb: float = 64.0
    """The model's size: the small Llama is scaled to about this many MiB."""
    bucket_mb: int = 32
    address: str | None = None
    """A Ray cluster to join (None: start a local one on this machine)."""
    delta: bool = False
    """Delta updates (``SyncConfig.delta``) of bf16 rollout weights trained at an RL learning rate; each step's line
    then says how many bytes crossed per receiver."""
    staged: bool = False
    """Staged updates (``SyncConfig.staged``): the replicas serve while the update is staged, paused only to swap."""
    tp: int = 1
    """Workers per replica, each holding its tensor-parallel part of every layer (``weightsync.api.parts``): each
    reads and verifies only its part of every update."""


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def step_line(report: UpdateReport, step: str, *, exact: bool, delta: bool) -> str:
    """What the demo prints for one step's update."""
    sent = ""
    if delta:
        full = sum(outcome.received == "full" for outcome in report.replicas)
        sent = (f"  sent {report.wire_bytes / 1e6:.1f} MB ({report.changed_fraction:.1%} changed; "
                f"{full}/{len(report.replicas)} replicas full)")
    parted = [transfer.part_bytes for transfer in report.transfers if transfer.role == "rollout" and transfer.part >= 0]
    if parted:
        sent += f"  each worker verified its part ({max(parted) / 1e6:.1f} MB)"
    paused = max((outcome.pause_seconds for outcome in report.replicas), default=0.0)
    return (f"step {step}  version {report.version}  {report.nbytes / 1e6:.1f} MB{sent}  "
            f"{report.transfer_seconds:.3f} s  {report.gbps_per_receiver:.2f} GB/s per receiver  "
            f"digest {'ok' if report.ok else 'MISMATCH'}  logits {'bit-exact' if exact else 'DIFFER'}  "
            f"replicas paused {paused * 1e3:.0f} ms")


def make_replicas(options: DemoOptions, config: LlamaConfig, served: torch.dtype, node_id: str | None
                  ) -> list[Any]:
    """The demo's replicas: one worker each holding the whole model, or ``options.tp`` workers each holding its
    tensor-parallel part; on ``node_id`` (None: where Ray places them)."""
    from weightsync.ray import RayRolloutReplica

    if options.tp == 1:
        return [RayRolloutReplica.create(replica=index, sink_factory=functools.partial(
            DemoRolloutModel, config=config, dtype=served), node_id=node_id) for index in range(options.replicas)]
    parts = [tensor_parallel_part(config, rank, options.tp) for rank in range(options.tp)]  # ConfigError if uneven
    return [RayRolloutReplica.create(replica=index, sink_factory=functools.partial(DemoShard, config=config,
                                                                                      tp=options.tp),
                                     num_workers=options.tp, parts=parts, node_id=node_id)
            for index in range(options.replicas)]


async def replica_logits(replicas: list[Any], config: LlamaConfig, tp: int) -> list[bytes]:
    """Each replica's logits of ``PROMPT`` (a tensor-parallel replica's from its workers' shards put together)."""
    if tp == 1:
        return list(await asyncio.gather(*(replica.call("logits", PROMPT)[0] for replica in replicas)))
    shards = [await asyncio.gather(*replica.call("shard")) for replica in replicas]
    return [assembled_logits(list(held), config, PROMPT) if all(held) else b"" for held in shards]


async def run_demo(options: DemoOptions) -> int:
    import ray

    from weightsync.core.control.manager import CheckpointEngineManager
    from weightsync.ray import RayActorWorkerGroup

    if min(options.steps, options.replicas, options.bucket_mb, options.tp) < 1 or options.model_mb <= 0:
        raise SystemExit("weightsync demo: --steps, --replicas, --model-mb, --bucket-mb and --tp must be positive")
    started = time.perf_counter()
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # "local" starts a cluster of our own even when another one runs on this machine.
    ray.init(address=options.address or "local", include_dashboard=False, logging_level="ERROR", log_to_driver=True,
             ignore_reinit_error=True)
    # A cluster of our own is this machine: every actor on it, so that each knows its local rank when made and
    # they all start side by side (weightsync.ray.group); on a cluster given by --address, Ray places them.
    node_id = None if options.address else ray.get_runtime_context().get_node_id()
    config = config_for_megabytes(options.model_mb)
    served = torch.bfloat16 if options.delta else torch.float32
    lr = RL_LR if options.delta else TRAIN_LR
    model_bytes = config.parameters * served.itemsize
    print(f"weightsync demo: backend {options.backend}, TinyLlama {config.num_layers} layers "
          f"({model_bytes / 1e6:.1f} MB {'bf16, fp32 masters' if options.delta else 'fp32'}, AdamW lr {lr:g}), "
          f"actor_wg of 2 ranks, {options.replicas} rollout replicas"
          f"{f' of {options.tp} workers, each holding its part' if options.tp > 1 else ''}"
          f"{', staged updates' if options.staged else ''}")
    progress = Progress(options.steps)
    actor_wg: Any = None
    replicas: list[Any] = []
    exact_steps = 0
    try:
        actor_wg = RayActorWorkerGroup.create(
            world_size=2, source_factory=functools.partial(DemoTrainer, config=config, lr=lr, served=served),
            node_id=node_id,
        )
        replicas = make_replicas(options, config, served, node_id)
        address = await actor_wg.call("address")[0]
        await asyncio.gather(*actor_wg.call("join", f"tcp://{address}:{free_port()}"))
        manager = CheckpointEngineManager(
            backend=options.backend, actor_wg=actor_wg, replicas=replicas,
            config=SyncConfig(bucket_bytes=options.bucket_mb * MiB, delta=options.delta, staged=options.staged),
        )
        trainer_logits = await actor_wg.call("logits", PROMPT)[0]
        before = await replica_logits(replicas, config, options.tp)
        if options.tp == 1 and (any(logits == trainer_logits for logits in before) or len(set(before)) != len(before)):
            print("error: replicas did not start from weights of their own")
            return 1
        previous = ""
        for step in range(1, options.steps + 1):
            progress.show(step - 1, f"step {step}: training")
            digests = await asyncio.gather(*actor_wg.call("train_step", step))
            if len(set(digests)) != 1 or digests[0] == previous:
                print(f"step {step}: error: the optimizer step did not change the weights identically on every rank")
                return 1
            previous = digests[0]
            progress.show(step - 1, f"step {step}: syncing")
            report = await manager.update_weights(version=step)
            expected = await actor_wg.call("logits", PROMPT)[0]
            got = await replica_logits(replicas, config, options.tp)
            exact = all(logits == expected for logits in got)
            exact_steps += exact
            progress.show(step, f"step {step}: {'bit-exact' if exact else 'MISMATCH'}")
            print(step_line(report, f"{step}/{options.steps}", exact=exact, delta=options.delta), flush=True)
    except WeightsyncError as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
    finally:
        for replica in replicas:
            replica.shutdown()
        if actor_wg is not None:
            actor_wg.shutdown()
        ray.shutdown()
    print(f"({time.perf_counter() - started:.1f} s in all)")
    print(f"{exact_steps}/{options.steps} steps bit-exact")
    return 0 if exact_steps == options.steps else 1
