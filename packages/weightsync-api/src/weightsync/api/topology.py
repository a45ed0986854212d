"""Topology helpers every driver shares: build a checked topology, and stamp it with a membership epoch.

A driver (weightsync's manager, the verl adapter's ``build_topology`` shim, the conformance harness) asks an engine
class for its topology with :func:`build_checked_topology`, which calls ``build_topology`` by keyword and holds the
result to the Protocol's promises, so that a bad topology fails on the driver, naming the backend, instead of as a
hang in ``init_process_group``. :func:`with_epoch` gives every rank the token of the membership epoch the topology
starts. Plain data only: no torch, no ray.
"""

from __future__ import annotations

import dataclasses

import secrets
from collections.abc import Mapping

from weightsync.api.errors import TopologyError, WeightsyncError
from weightsync.api.protocols import CheckpointEngine
from weightsync.api.sources import SOURCE_KEY
from weightsync.api.types import Topology, WorldMetadata

__all__ = ["build_checked_topology", "check_sizes", "epoch_of", "with_epoch"]

EPOCH = "epoch"
"""The key of ``rank_args`` that carries the membership epoch's token (``with_epoch`` writes it)."""


def with_epoch(topology: Topology) -> Topology:
    """Stamp every rank's arguments with one fresh membership-epoch token (kept where already present).

    The token is born on the driver and reaches workers only through ``init_process_group``'s arguments — the
    control plane — so it works whichever manager drives the lifecycle. Every connection of ours must present it.
    """
    token = secrets.token_hex(16)
    return dataclasses.replace(
        topology, actor=[{EPOCH: token, **args} for args in topology.actor],
        rollout=[{EPOCH: token, **args} for args in topology.rollout])


def epoch_of(rank_args: Mapping[str, object]) -> str:
    """The membership epoch's token in one rank's ``rank_args`` ("" when it carries none): what a driver or an
    adapter that relays ``rank_args`` needs of them without knowing the engine's plan."""
    token = rank_args.get(EPOCH)
    return token if isinstance(token, str) else ""


def check_sizes(*, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata) -> None:
    """Raise :class:`TopologyError` unless both sizes are non-negative ints that match ``metadata``'s sides."""
    for label, size in (("actor_wg_world_size", actor_wg_world_size), ("rollout_world_size", rollout_world_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise TopologyError(f"{label} must be a non-negative int, got {size!r}")
    for side, label, size in (("actor", "actor_wg_world_size", actor_wg_world_size),
                              ("rollout", "rollout_world_size", rollout_world_size)):
        got = len(getattr(metadata, side))
        if got != size:
            raise TopologyError(f"{label}={size} but metadata holds {got} {side} entries")


def build_checked_topology(
    engine_class: type[CheckpointEngine], *, backend: str, actor_wg_world_size: int, rollout_world_size: int,
    metadata: WorldMetadata,
) -> Topology:
    """``engine_class.build_topology(...)`` by keyword, checked: a :class:`Topology` whose lists match the sizes, and
    one built for a sharded ``actor_wg`` where its ranks declared source layouts (``weightsync.api.sources``).

    ``backend`` names the engine class in errors. Our typed errors pass through; anything else ``build_topology``
    raises, and any other return value, becomes a ``TopologyError``.
    """
    check_sizes(actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata)
    try:
        topology = engine_class.build_topology(
            actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size, metadata=metadata
        )
    except WeightsyncError:
        raise
    except Exception as exc:
        raise TopologyError(f"{backend}.build_topology failed: {exc!r}") from exc
    if not isinstance(topology, Topology):
        raise TopologyError(f"{backend}.build_topology returned {type(topology).__name__}, not Topology")
    topology.check(actor_wg_world_size=actor_wg_world_size, rollout_world_size=rollout_world_size)
    if not topology.sharded and any(SOURCE_KEY in entry for entry in metadata.actor):
        # Its senders would each send a shard as if it were the model: refused, never sent.
        raise TopologyError(f"{backend} does not send from a sharded actor_wg (its ranks declared source layouts): "
                            "sharded sources go over shm on one host, or a chain backend with "
                            "layout='two_level' (backend='auto' picks them)")
    return topology
