"""Parts at setup: the parts rollout workers declared in their ``prepare`` metadata (``weightsync.api.parts``), made
distinct and handed out with the plan — every sender the list, every worker that declared one its own.

Equal parts (the same regions of the same tensors: the workers of one tensor-parallel rank across replicas) are one
entry of the list, so the sender hashes each distinct part once.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.parts import PART_KEY, Part
from weightsync.api.types import RankArgs, WorkerMetadata
from weightsync.core.transports.plan import with_parts
from weightsync.core.wire.parts import PartPlan

__all__ = ["declared_parts", "with_declared_parts"]


def declared_parts(rollout: Sequence[WorkerMetadata], labels: Sequence[str]) -> list[PartPlan | None]:
    """Each rollout worker's part as a plan entry (None: it declared none, the whole model), equal parts sharing an
    index; a ``TopologyError`` naming the worker whose declaration is malformed."""
    plans: list[PartPlan | None] = []
    known: dict[bytes, PartPlan] = {}
    for metadata, label in zip(rollout, labels):
        declared = metadata.get(PART_KEY)
        if declared is None:
            plans.append(None)
            continue
        try:
            part = Part.from_dict(declared)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise TopologyError(f"{label}: malformed part in its metadata: {exc}", field=f"$.{PART_KEY}") from None
        plan = PartPlan.of(part, len(known))
        plans.append(known.setdefault(plan.key(), plan))
    return plans


def with_declared_parts(actor_args: list[RankArgs], rollout_args: list[RankArgs], parts: Sequence[PartPlan | None],
                        *, staged: bool = False) -> None:
    """Hand out the parts (in place): every actor rank the distinct ones, every rollout worker its own. Where every
    rollout worker declared one and the updates are not ``staged`` (a host's stager checks the whole digest of what
    it stages), no receiver checks the whole digest: the senders are told not to compute it (``parts_only``)."""
    distinct = sorted({part.index: part for part in parts if part is not None}.values(), key=lambda part: part.index)
    if not distinct:
        return
    parts_only = not staged and all(part is not None for part in parts)
    actor_args[:] = [with_parts(args, parts=distinct, parts_only=parts_only) for args in actor_args]
    for rank, part in enumerate(parts):
        if part is not None:
            rollout_args[rank] = with_parts(rollout_args[rank], part=part)

