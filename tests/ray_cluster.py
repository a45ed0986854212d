"""One actor worker group and its rollout replicas as Ray worker processes on the session's cluster, for tests that
drive ``CheckpointEngineManager`` end to end and look at what each replica holds from outside the engine."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from dataclasses import dataclass

import ray

from tests.conftest import RayNodes
from tests.workloads import ModelSource, RecordingSink
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica


def kill_actor(pid_of: Callable[[], Any], what: str) -> None:
    """SIGKILL the actor whose ``pid`` call ``pid_of()`` makes (an ObjectRef), and wait (bounded) until Ray says it
    is dead."""
    os.kill(int(ray.get(pid_of())), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(pid_of(), timeout=5)
        except ray.exceptions.ActorDiedError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"Ray did not declare {what}'s actor dead within 30 s")


@dataclass
class Cluster:
    actor_wg: RayActorWorkerGroup
    replicas: list[RayRolloutReplica]
    nodes: RayNodes

    def add(self, sink: type[RecordingSink] = RecordingSink) -> RayRolloutReplica:
        """A new replica on the head node, last in ``replicas``."""
        replica = RayRolloutReplica.create(replica=len(self.replicas), sink_factory=sink, node_id=self.nodes.head)
        self.replicas.append(replica)
        return replica

    def version(self, version: int) -> str:
        """Make ``version`` the actor's model (a source with ``set_version``); its digest, from its own tensors."""
        return str(ray.get(self.actor_wg.call("set_version", version)[0]))

    def digests(self, replicas: list[int] | None = None) -> list[str]:
        """What the given replicas (default: all) hold, each hashed by its worker from its own tensors' bytes."""
        chosen = range(len(self.replicas)) if replicas is None else replicas
        return [str(ray.get(self.replicas[index].call("digest")[0])) for index in chosen]

    def pid(self, replica: int) -> int:
        return int(ray.get(self.replicas[replica].call("pid")[0]))

    def hooks(self, replica: int) -> list[str]:
        return list(ray.get(self.replicas[replica].call("hook_log")[0]))


@contextmanager
def running_cluster(nodes: RayNodes, source: type[ModelSource], *, replicas: int = 0,
                    sink: type[RecordingSink] = RecordingSink) -> Iterator[Cluster]:
    """One actor rank of ``source`` and ``replicas`` replicas of ``sink``, all on the head node; every worker is shut
    down on the way out, those added during the test included."""
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=source, node_id=nodes.head)
    made = Cluster(actor_wg, [], nodes)
    try:
        for _ in range(replicas):
            made.add(sink)
        yield made
    finally:
        for replica in made.replicas:
            replica.shutdown()
        actor_wg.shutdown()
