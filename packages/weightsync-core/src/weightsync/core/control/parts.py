"""Parts at setup: the parts rollout workers declared in their ``prepare`` metadata (``weightsync.api.parts``), made
distinct (:func:`~weightsync.core.wire.parts.declared_parts`, where they are decoded: the chain's part groups read
them too) and handed out with the plan — every sender the list, every worker that declared one its own.

Equal parts (the same regions of the same tensors: the workers of one tensor-parallel rank across replicas) are one
entry of the list, so the sender hashes each distinct part once.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.types import RankArgs
from weightsync.core.transports.plan import with_parts
from weightsync.core.wire.blocks import candidates
from weightsync.core.wire.parts import PartPlan, declared_parts

__all__ = ["declared_parts", "with_declared_parts"]


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

