"""What the nixl and mooncake chain tests share: an I/O log kept by wrappers around the transfer library in each
worker process, probed sources and sinks that install the wrappers, a Ray world, and the checks.

The numbers come from the library calls themselves (wrapped in the worker processes), never from the engine's
own reports: bytes are counted on the receiving side, per upstream the read targeted.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray

from tests.workloads import ModelSource, RecordingSink, model_tensors, weights_digest
from weightsync.api.config import SyncConfig
from weightsync.api.types import JsonValue, UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

BUCKET = 256 * 1024
TENSORS = 12
NUMEL = 51_200  # every tensor a multiple of the 256-byte bucket alignment: buckets carry no padding
MODEL_BYTES = sum(tensor.numel() * tensor.element_size() for _, tensor in model_tensors(1, tensors=TENSORS,
                                                                                         numel=NUMEL))


class IoLog:
    """One process's view of the library: identities it created, registrations, and the reads it issued."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.identities: list[str] = []
        self.registrations = 0
        self.registered_bytes = 0
        self.deregistrations = 0
        self.reads: dict[str, int] = {}

    def identity(self, name: str) -> None:
        with self._lock:
            self.identities.append(name)

    def registered(self, nbytes: int) -> None:
        with self._lock:
            self.registrations += 1
            self.registered_bytes += nbytes

    def deregistered(self) -> None:
        with self._lock:
            self.deregistrations += 1

    def read(self, target: str, nbytes: int) -> None:
        with self._lock:
            self.reads[target] = self.reads.get(target, 0) + nbytes

    def snapshot(self) -> dict[str, JsonValue]:
        with self._lock:
            return {
                "identities": list(self.identities), "registrations": self.registrations,
                "registered_bytes": self.registered_bytes, "deregistrations": self.deregistrations,
                "reads": dict(self.reads),
            }


class ProbedSourceBase(ModelSource):
    install: ClassVar[Callable[[], None]]
    log: ClassVar[IoLog]

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, tensors=TENSORS, numel=NUMEL)
        type(self).install()

    def io_log(self) -> dict[str, JsonValue]:
        return self.log.snapshot()


class ProbedSinkBase(RecordingSink):
    install: ClassVar[Callable[[], None]]
    log: ClassVar[IoLog]

    def __init__(self, replica: int, worker: int) -> None:
        super().__init__(replica, worker)
        type(self).install()

    def io_log(self) -> dict[str, JsonValue]:
        return self.log.snapshot()


@dataclass
class ChainWorld:
    backend: str
    source: type[ProbedSourceBase]
    sink: type[ProbedSinkBase]
    node_id: str
    actor_wg: RayActorWorkerGroup
    replicas: list[RayRolloutReplica] = field(default_factory=list)

    def add_replica(self) -> RayRolloutReplica:
        replica = RayRolloutReplica.create(replica=len(self.replicas), sink_factory=self.sink, node_id=self.node_id)
        self.replicas.append(replica)
        return replica

    def manager(self, *, replicas: list[RayRolloutReplica] | None = None, bucket_bytes: int = BUCKET,
                **backend_options: JsonValue) -> CheckpointEngineManager:
        return CheckpointEngineManager(
            backend=self.backend, actor_wg=self.actor_wg,
            replicas=self.replicas if replicas is None else replicas,
            config=SyncConfig(bucket_bytes=bucket_bytes, backend_options=backend_options),
        )

    def set_version(self, version: int) -> str:
        return str(ray.get(self.actor_wg.call("set_version", version))[0])

    def update(self, manager: CheckpointEngineManager, version: int) -> UpdateReport:
        return asyncio.run(manager.update_weights(version=version))

    def digests(self, replicas: list[RayRolloutReplica] | None = None) -> list[str]:
        return [str(ray.get(ref)) for replica in (replicas or self.replicas) for ref in replica.call("digest")]

    def sender_log(self) -> dict[str, Any]:
        logs: list[dict[str, Any]] = ray.get(self.actor_wg.call("io_log"))
        return logs[0]

    def sender_identity(self) -> str:
        """The identity of the sender's live engine: the last one its process created.

        Older identities are not used: once their engine is closed, the port (Mooncake's identity is host:port) can
        be handed to a receiver's new engine, and reads from that receiver would be counted as the sender's.
        """
        identities: list[str] = self.sender_log()["identities"]
        assert identities  # the wrappers saw the sender's engine (positive control of the identity capture)
        return identities[-1]

    def receiver_logs(self, replicas: list[RayRolloutReplica] | None = None) -> list[dict[str, Any]]:
        return [ray.get(ref) for replica in (replicas or self.replicas) for ref in replica.call("io_log")]

    def all_logs(self) -> list[dict[str, Any]]:
        return [*ray.get(self.actor_wg.call("io_log")), *self.receiver_logs()]


@contextlib.contextmanager
def chain_world(*, backend: str, source: type[ProbedSourceBase], sink: type[ProbedSinkBase], node_id: str,
                replicas: int) -> Iterator[ChainWorld]:
    """An actor worker group of two ranks (rank 0 sends, rank 1 drains) and ``replicas`` one-worker replicas."""
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=source, node_id=node_id)
    world = ChainWorld(backend, source, sink, node_id, actor_wg)
    try:
        for _ in range(replicas):
            world.add_replica()
        yield world
    finally:
        actor_wg.shutdown()
        for replica in world.replicas:
            replica.shutdown()


def bytes_read_from(logs: list[dict[str, Any]], identity: str) -> int:
    """Bytes the receivers' processes read from ``identity`` (counted on the receiving side)."""
    return sum(nbytes for log in logs for target, nbytes in log["reads"].items() if target == identity)


def reads_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[dict[str, Any]]:
    deltas = []
    for old, new in zip(before, after):
        reads = {target: nbytes - old["reads"].get(target, 0) for target, nbytes in new["reads"].items()}
        deltas.append({**new, "reads": {target: nbytes for target, nbytes in reads.items() if nbytes}})
    return deltas


def check_sender_sent_one_model(*, sender_bytes: int, per_receiver: list[int], model_bytes: int) -> None:
    """The acceptance check: the sender's egress is one model, and every receiver got one model."""
    if sender_bytes != model_bytes:
        raise AssertionError(f"the sender sent {sender_bytes} bytes for a {model_bytes}-byte model")
    if any(received != model_bytes for received in per_receiver):
        raise AssertionError(f"receivers read {per_receiver} bytes, expected {model_bytes} each")


def check_bit_exact(digests: list[str], expected: str) -> None:
    wrong = [index for index, digest in enumerate(digests) if digest != expected]
    if wrong:
        raise AssertionError(f"rollout ranks {wrong} do not hold the expected weights")


def expected_digest(version: int) -> str:
    return weights_digest(model_tensors(version, tensors=TENSORS, numel=NUMEL))
