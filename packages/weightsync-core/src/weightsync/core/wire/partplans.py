"""The parts rollout workers declared, as the driver plans with them: each distinct part an entry of the senders'
list (:class:`PartPlan`), decoded once from the workers' ``prepare`` metadata (:func:`declared_parts`), and what the
hosts need of the model together (:func:`skipped_by_host`, :func:`part_groups`). What a part is in bytes, and the sums
that verify it, are :mod:`weightsync.core.wire.parts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.parts import PART_KEY, Part
from weightsync.api.types import WorkerMetadata

__all__ = ["Box", "PartPlan", "declared_parts", "part_groups", "skipped_by_host"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


class PartPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One distinct part in a plan: its place in the senders' list (``index``) and its regions, name → boxes
    (``(start, size)``); a name not listed is held whole, one listed with no box not at all."""

    index: int
    tensors: dict[str, list[Box]] = {}

    @classmethod
    def of(cls, part: Part, index: int) -> PartPlan:
        return cls(index=index, tensors={name: [(region.start, region.size) for region in regions]
                                         for name, regions in part.tensors.items()})

    def holds_none(self, name: str) -> bool:
        """Whether this part holds nothing of tensor ``name`` (listed with no box)."""
        return self.tensors.get(name) == []

    def key(self) -> bytes:
        """What equal parts share (their regions, whatever their index)."""
        return msgspec.msgpack.encode(sorted(self.tensors.items()))


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


def skipped_by_host(parts: Sequence[PartPlan | None], hosts: Sequence[str]) -> dict[str, frozenset[str]]:
    """Per host (in the order hosts first appear), the checkpoint tensors none of its workers holds anything of: what
    a host receiving only its workers' parts (rounded up to whole tensors) need not receive. A worker that declared
    no part holds everything, so its host skips nothing."""
    skipped: dict[str, frozenset[str]] = {}
    for host in dict.fromkeys(hosts):
        mine = [part for part, where in zip(parts, hosts) if where == host]
        if any(part is None for part in mine):
            skipped[host] = frozenset()
            continue
        nothing = [{name for name, boxes in part.tensors.items() if not boxes} for part in mine if part is not None]
        skipped[host] = frozenset(set.intersection(*nothing))
    return skipped


def part_groups(parts: Sequence[PartPlan | None], hosts: Sequence[str]) -> list[tuple[frozenset[str], list[str]]]:
    """The hosts grouped by what they skip (:func:`skipped_by_host`): each group's hosts can share one stream that
    leaves those tensors out. In the order the groups' first hosts appear; one group where every host needs the
    same (today's delivery)."""
    groups: dict[frozenset[str], list[str]] = {}
    for host, skipped in skipped_by_host(parts, hosts).items():
        groups.setdefault(skipped, []).append(host)
    return list(groups.items())
