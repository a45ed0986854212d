"""Ray actors as weightsync's ``ActorWorkerGroup`` and ``RolloutReplica``.

Each Ray actor hosts one engine (through ``weightsync.core.EngineHost``) next to a user object built inside the
actor by a factory: a ``WeightSource`` on actor ranks (your trainer's model), a ``WeightSink`` on rollout workers
(your inference model). ``call(method, ...)`` reaches that object's own methods. Every method returns Ray
``ObjectRef``s, which the manager awaits — nothing here calls ``ray.get``.

Works on a bare ``ray.init()`` (embedded local cluster) and on an existing cluster; pass ``node_id=`` to pin actors to
a node. Actors reserve ``num_cpus=0`` by default: they are hosts for your code, so size them through
``ray_options`` the way your deployment needs.
"""

from importlib.metadata import version as _version

from weightsync.ray.group import (
    ActorRankHost,
    RayActorWorkerGroup,
    RayHostWorker,
    RayRolloutReplica,
    RayRolloutWorker,
    RayStagingWorker,
    RolloutWorkerHost,
)

__version__ = _version("weightsync-ray")
"""This distribution's version (from its installed metadata)."""

__all__ = ["ActorRankHost", "RayActorWorkerGroup", "RayHostWorker", "RayRolloutReplica", "RayRolloutWorker",
           "RayStagingWorker", "RolloutWorkerHost"]
