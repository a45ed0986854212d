"""The typed plan: what ``build_topology`` hands each rank (``rank_args``), as msgspec structs declared beside the
transport that produces them and decoded once, where they arrive (the engine's ``init_process_group``).

On its way (Ray, vLLM's RPC, the driver) a plan is plain data — ``RankArgs``, a mapping — as the ``CheckpointEngine``
Protocol has it: :func:`encode_plan` makes it, :func:`decode_plan` turns it back into its struct, checked field by
field; a malformed plan is a ``TopologyError`` naming the field (``field``: its path, ``$.sources[1].upstream``), as
a malformed wire message is a ``WireError``. Every plan carries a tag (``kind``) that says which struct it is; a
transport that takes several (a chain receiver of one stripe or of all of them) declares their union
(``Transport.plans``).

What every plan says (:class:`RankPlan`): the membership epoch's token (``epoch``: stamped on the driver,
``weightsync.api.topology.with_epoch``), the actor rank whose stream the rank takes part in (``sender``), the
version every receiver holds when the senders may send only what changed since it (``delta_base``), the parts the
receivers declared (a sender's ``parts``, a receiver's ``part``: :mod:`weightsync.core.wire.parts`), and from its kind
the rank's role (sender, receiver or idle) and stripe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

import msgspec

from weightsync.api.errors import TopologyError
from weightsync.api.types import RankArgs
from weightsync.core.wire.blocks import BlockPlan
from weightsync.core.wire.partplans import Box, PartPlan

__all__ = ["Idle", "RankPlan", "RankRole", "decode", "decode_metadata", "decode_plan", "encode_plan", "with_delta_base",
           "with_parts"]

RankRole = Literal["sender", "receiver", "idle"]

Plan = TypeVar("Plan")


class RankPlan(msgspec.Struct, kw_only=True, frozen=True, tag_field="kind", forbid_unknown_fields=True,
               omit_defaults=True):
    """What every rank's plan says; each transport's plans derive from it (a tag of their own each)."""

    role: ClassVar[RankRole] = "idle"
    epoch: str = ""
    """The membership epoch's token; every connection of the epoch presents it."""
    sender: int = 0
    """The actor rank whose stream this rank sends or receives (a stripe's sender for a stager of one stripe)."""
    delta_base: int | None = None
    """A sender's: the version every receiver holds, which this update may send changes against (the manager's)."""
    parts: list[PartPlan] = []
    """A sender's: every distinct part its receivers declared, whose sums a full update's final header carries."""
    parts_only: bool = False
    """A sender's: every receiver verifies its part (none checks the whole digest): a full update's whole digest is
    not computed, the parts' sums are (``weightsync.core.wire.parts.PartsDigest``)."""
    blocked: dict[str, BlockPlan] = {}
    """A sender's: the tensors every receiver's part holds one block of (along a dimension past the first), which a
    full update verified by parts packs block after block (:mod:`weightsync.core.wire.blocks`)."""
    skip: tuple[str, ...] = ()
    """A sender's: the tensors it leaves out of its stream, which none of its receivers holds anything of (a part
    group's sender: :mod:`weightsync.core.transports.chain.groups`)."""
    carry: dict[str, list[Box]] = {}
    """A sender's: the tensors of which it sends only the span of these regions, its receivers' together (a part
    group's sender, whose hosts hold less than whole tensors: :mod:`weightsync.core.wire.carriers`)."""
    streams: tuple[int, ...] = ()
    """A receiver's, of a sharded ``actor_wg``: the actor ranks whose streams it reads, each sending the shards it
    holds (:mod:`weightsync.core.transports.sources`); empty: one stream, ``sender``'s."""
    part: PartPlan | None = None
    """A rollout worker's that declared its part (a receiver, or an idle worker that reads a staging area): its
    regions, and its place in the senders' ``parts``."""

    @property
    def striping(self) -> tuple[int, int]:
        """(s, K): the stripe this rank sends or stages of an update dealt into K; a receiver of every stripe (0, K);
        (0, 1) unstriped."""
        return 0, 1

    @property
    def one_stripe(self) -> bool:
        """A receiver that holds one stripe of a striped update (a stager of a staged one), not the update."""
        return False


class Idle(RankPlan, tag="idle", frozen=True):
    """A rank that neither sends nor receives in this epoch (an actor rank other than the senders: it still drains
    its stream; a rollout worker of a staged update that is not its host's stager: it reads the staging area)."""


def encode_plan(plan: RankPlan) -> RankArgs:
    """``plan`` as plain data, for the way to its rank: its ``kind`` and every field that differs from its default
    (an ``epoch`` left empty is stamped later, by ``with_epoch``)."""
    encoded: RankArgs = msgspec.to_builtins(plan)
    return encoded


def with_delta_base(rank_args: RankArgs, base: int) -> RankArgs:
    """A sender's ``rank_args`` with the manager's ``delta_base`` (:attr:`RankPlan.delta_base`)."""
    return {**rank_args, "delta_base": base}


def with_parts(rank_args: RankArgs, *, parts: list[PartPlan] | None = None, part: PartPlan | None = None,
               parts_only: bool = False, blocked: dict[str, BlockPlan] | None = None) -> RankArgs:
    """``rank_args`` with the manager's parts: a sender's ``parts`` (and ``parts_only``, ``blocked``), a rollout
    worker's ``part``."""
    added: RankArgs = {}
    if parts:
        added["parts"] = msgspec.to_builtins(parts)
    if parts_only:
        added["parts_only"] = True
    if blocked:
        added["blocked"] = msgspec.to_builtins(blocked)
    if part is not None:
        added["part"] = msgspec.to_builtins(part)
    return {**rank_args, **added}


def decode_plan(rank_args: RankArgs, kinds: Any, *, who: str) -> Any:
    """``rank_args`` as the struct its ``kind`` names, one of ``kinds`` (a plan class or a union of them): a
    ``TopologyError`` naming ``who`` and the field when it is not one of them or a field is missing or malformed."""
    return decode(rank_args, kinds, who=who, what="rank_args")


def decode_metadata(metadata: Mapping[str, Any], kind: type[Plan], *, who: str) -> Plan:
    """A worker's ``prepare`` metadata (or ``ping`` answer) as ``kind`` (a struct that reads some of its keys and
    leaves the others): a ``TopologyError`` naming ``who`` and the field when one is malformed."""
    decoded: Plan = decode(metadata, kind, who=who, what="metadata")
    return decoded


def decode(data: Mapping[str, Any], kind: Any, *, who: str, what: str) -> Any:
    """``data`` converted to ``kind`` by msgspec, checked field by field; a ``TopologyError`` naming the field."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        where, named = re.search(r"- at `([^`]+)`", str(exc)), re.search(r"field `([^`]+)`", str(exc))
        field = where.group(1) if where else "$"
        if named:  # a field missing, or one the plan does not have
            field = f"{field}.{named.group(1)}"
        raise TopologyError(f"{who}: malformed {what} ({exc}): {dict(data)!r}", field=field) from None
