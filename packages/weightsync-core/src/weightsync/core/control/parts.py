"""Parts at setup: the parts rollout workers declared in their ``prepare`` metadata (``weightsync.api.parts``), made
distinct (:func:`~weightsync.core.wire.partplans.declared_parts`, where they are decoded: the chain's part groups read
them too) and handed out with the plan — every sender the list, every worker that declared one its own.

Equal parts (the same regions of the same tensors: the workers of one tensor-parallel rank across replicas) are one
entry of the list, so the sender hashes each distinct part once.

A worker that receives for others of its host (a staged update's stager, :func:`members_metadata`) declares what
they hold together to the topology, so a host stages only what its workers hold (the chain's part groups).
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.parts import PART_KEY
from weightsync.api.types import RankArgs, WorkerMetadata
from weightsync.core.transports.place import Place
from weightsync.core.transports.plan import decode_metadata, with_parts
from weightsync.core.wire.blocks import candidates
from weightsync.core.wire.partplans import PartPlan, declared_parts, held_by_host

__all__ = ["declared_parts", "members_metadata", "with_declared_parts"]


def members_metadata(rollout: Sequence[WorkerMetadata], members: Sequence[int], labels: Sequence[str]
                     ) -> list[WorkerMetadata]:
    """The metadata the topology is built from: the ``members``' (the rollout workers that join the transport's
    world). Where some workers of a host do not join (a staged update: the host's stagers receive, its other workers
    read the staging area), each member of that host declares as its part what all the host's workers hold together
    (:func:`~weightsync.core.wire.partplans.held_by_host`): the tensors none of them holds anything of are left out,
    those each holds regions of are their regions (carried as their span), every other is whole (no part where that
    leaves nothing out). Each worker is still handed its own part (:func:`with_declared_parts`)."""
    if len(members) == len(rollout):
        return list(rollout)
    hosts = [decode_metadata(entry, Place, who=label).node_id for entry, label in zip(rollout, labels)]
    held = held_by_host(declared_parts(rollout, labels), hosts)
    chosen: list[WorkerMetadata] = []
    for member in members:
        entry = {key: value for key, value in rollout[member].items() if key != PART_KEY}
        if held[hosts[member]].tensors:
            entry[PART_KEY] = held[hosts[member]].as_part().to_dict()
        chosen.append(entry)
    return chosen


def with_declared_parts(actor_args: list[RankArgs], rollout_args: list[RankArgs], parts: Sequence[PartPlan | None],
                        *, staged: bool = False) -> None:
    """Hand out the parts (in place): every actor rank the distinct ones, every rollout worker its own. Where every
    rollout worker declared one and the updates are not ``staged`` (a host's stager checks the whole digest of what
    it stages), no receiver checks the whole digest: the senders are told not to compute it (``parts_only``)."""
    distinct = sorted({part.index: part for part in parts if part is not None}.values(), key=lambda part: part.index)
    if not distinct:
        return
    parts_only = not staged and all(part is not None for part in parts)
    # Where every receiver holds one block of a tensor along a dimension past the first, a full update verified by
    # parts may pack it block after block (weightsync.core.wire.blocks): each worker's block then lies contiguous.
    blocked = candidates([part.tensors for part in distinct]) if parts_only else {}
    actor_args[:] = [with_parts(args, parts=distinct, parts_only=parts_only, blocked=blocked) for args in actor_args]
    for rank, part in enumerate(parts):
        if part is not None:
            rollout_args[rank] = with_parts(rollout_args[rank], part=part)

