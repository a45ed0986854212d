"""The parts rollout workers declared, as the driver plans with them: each distinct part an entry of the senders'
list (:class:`PartPlan`), decoded once from the workers' ``prepare`` metadata (:func:`declared_parts`), and what the
hosts need of the model together (:func:`held_by_host`, :func:`part_groups`). What a part is in bytes, and the sums
that verify it, are :mod:`weightsync.core.wire.parts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.parts import PART_KEY, Part, Region
from weightsync.api.types import WorkerMetadata

__all__ = ["Box", "PartPlan", "declared_parts", "held_by_host", "part_groups"]

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

    def as_part(self) -> Part:
        """The part these regions are (the inverse of :meth:`of`)."""
        return Part(tensors={name: tuple(Region(start=tuple(start), size=tuple(size)) for start, size in boxes)
                             for name, boxes in self.tensors.items()})

    def holds_none(self, name: str) -> bool:
        """Whether this part holds nothing of tensor ``name`` (listed with no box)."""
        return self.tensors.get(name) == []

    def none(self) -> tuple[str, ...]:
        """The tensors this part holds nothing of (what a stream to its holders leaves out: ``RankPlan.skip``)."""
        return tuple(name for name, boxes in self.tensors.items() if not boxes)

    def regions(self) -> dict[str, list[Box]]:
        """The tensors this part holds regions of, with their boxes (``RankPlan.carry``)."""
        return {name: boxes for name, boxes in self.tensors.items() if boxes}

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


def held_by_host(parts: Sequence[PartPlan | None], hosts: Sequence[str]) -> dict[str, PartPlan]:
    """Per host (in the order hosts first appear), what its workers hold together, as a part (``index`` -1): a
    tensor none of them holds whole listed with the boxes they hold of it (none: no box), one any of them holds whole
    not listed. A worker that declared no part holds everything, so its host's part lists nothing (the whole
    model)."""
    held: dict[str, PartPlan] = {}
    for host in dict.fromkeys(hosts):
        mine = [part for part, where in zip(parts, hosts) if where == host]
        if any(part is None for part in mine):
            held[host] = PartPlan(index=-1)
            continue
        plans = [part for part in mine if part is not None]
        tensors: dict[str, list[Box]] = {}
        for name in sorted(set().union(*(part.tensors for part in plans))):
            if all(name in part.tensors for part in plans):
                boxes: list[Box] = [(tuple(start), tuple(size)) for part in plans for start, size in part.tensors[name]]
                tensors[name] = list(dict.fromkeys(boxes))  # each box once
        held[host] = PartPlan(index=-1, tensors=tensors)
    return held


def part_groups(parts: Sequence[PartPlan | None], hosts: Sequence[str]) -> list[tuple[PartPlan, list[str]]]:
    """The hosts grouped by what they hold (:func:`held_by_host`): each group's hosts can share one stream that
    leaves out the tensors they hold nothing of and carries of those they hold regions of only those regions' span
    (``weightsync.core.wire.carriers``). In the order the groups' first hosts appear; one group where every host
    holds the same (today's delivery)."""
    groups: dict[bytes, tuple[PartPlan, list[str]]] = {}
    for host, held in held_by_host(parts, hosts).items():
        groups.setdefault(held.key(), (held, []))[1].append(host)
    return list(groups.values())
