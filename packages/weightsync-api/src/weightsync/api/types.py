"""Value types exchanged between the driver, the engines and the adapters.

Everything here is plain data: dataclasses of ``str``/``int``/``float``/``bool``, tuples, and JSON-like mappings.
They cross process boundaries (Ray, our own sockets through a typed codec) and must never need pickle to be
understood by a peer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args

from typing_extensions import TypeAlias

from weightsync.api.errors import TopologyError

__all__ = [
    "JsonValue",
    "WorkerMetadata",
    "RankArgs",
    "Role",
    "WorkerContext",
    "WorldMetadata",
    "Topology",
    "TransferReport",
    "PhaseTiming",
    "Received",
    "ReplicaState",
    "ReplicaOutcome",
    "StagedUpdate",
    "UpdateReport",
]

JsonValue: TypeAlias = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
"""A value that survives a JSON or msgpack round trip unchanged (modulo tuple → list)."""

WorkerMetadata: TypeAlias = dict[str, JsonValue]
"""What ``CheckpointEngine.prepare`` returns for one worker: addresses, ports, node, agent descriptors."""

RankArgs: TypeAlias = dict[str, JsonValue]
"""The keyword arguments ``build_topology`` decides for one rank; passed to ``init_process_group(rank_args=...)``."""

Role: TypeAlias = Literal["actor", "rollout"]


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """Where an engine instance runs, supplied by the hosting adapter (Ray, verl, the conformance kit).

    ``rank`` counts within the worker's own side: actor ranks 0..actor_wg_world_size-1, rollout ranks
    0..rollout_world_size-1 across all replicas. ``node_id`` identifies the host (two workers with the same
    ``node_id`` can share memory); ``host_ip`` is the address peers on other nodes reach this worker at.
    """

    role: Role
    rank: int
    node_id: str
    host_ip: str = "127.0.0.1"


@dataclass(frozen=True, kw_only=True)
class WorldMetadata:
    """All workers' ``prepare()`` results, as the driver hands them to ``build_topology``.

    ``actor[i]`` is actor rank i's metadata, ``rollout[j]`` rollout rank j's (replica by replica, worker by worker).
    """

    actor: Sequence[WorkerMetadata]
    rollout: Sequence[WorkerMetadata]


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Who sends to whom, as per-rank arguments for ``init_process_group``.

    ``actor[i]`` goes to actor rank i and ``rollout[j]`` to rollout rank j. ``senders`` lists the actor ranks
    whose ``send_weights`` actually transmits; every other actor rank still drains its weights stream (gathering a
    sharded model is collective) and sends nothing. With several senders each sends a disjoint part of the model.
    ``stripes``: the update is dealt into this many stripes, stripe s sent by ``senders[s]`` (bucket i in stripe
    i mod K) and every receiver reading them all; 1 (the default): each sender's part goes whole to its receivers.
    ``groups``: with stripes, the senders are that many groups of ``stripes`` each, one after another (group g's
    stripe s sent by ``senders[g * stripes + s]``): each group deals its own part of the model into stripes, to the
    receivers that read that group's stripes (``stripe_groups``).
    ``sharded``: the actor ranks hold shards of the model (``weightsync.api.sources``) and every sender sends what
    it holds, each its own stream, to receivers that read them all; the update's digest combines the senders' in
    the order of ``senders``.
    """

    actor: Sequence[RankArgs]
    rollout: Sequence[RankArgs]
    senders: tuple[int, ...] = (0,)
    stripes: int = 1
    groups: int = 1
    sharded: bool = False

    def check(self, *, actor_wg_world_size: int, rollout_world_size: int) -> None:
        """Raise :class:`TopologyError` unless the lists match the world sizes and the senders are actor ranks."""
        if len(self.actor) != actor_wg_world_size:
            raise TopologyError(
                f"topology has {len(self.actor)} actor entries but actor_wg_world_size is {actor_wg_world_size}"
            )
        if len(self.rollout) != rollout_world_size:
            raise TopologyError(
                f"topology has {len(self.rollout)} rollout entries but rollout_world_size is {rollout_world_size}"
            )
        if not self.senders:
            raise TopologyError("topology names no sending actor rank")
        bad = [rank for rank in self.senders if not 0 <= rank < actor_wg_world_size]
        if bad or len(set(self.senders)) != len(self.senders):
            raise TopologyError(f"topology senders {list(self.senders)} are not distinct actor ranks")
        for name, count in (("stripes", self.stripes), ("groups", self.groups)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise TopologyError(f"topology {name} must be a positive int, got {count!r}")
        if self.groups > 1 and self.stripes == 1:
            raise TopologyError(f"topology deals {self.groups} groups of stripes but no stripes")
        if self.stripes > 1 and self.stripes * self.groups != len(self.senders):
            raise TopologyError(f"topology deals {self.groups} x {self.stripes} stripes over senders "
                                f"{list(self.senders)}: a striped update has one sender per stripe")
        if self.sharded and self.stripes > 1:
            raise TopologyError("a topology of a sharded actor_wg is not dealt into stripes")

    @property
    def stripe_groups(self) -> tuple[tuple[int, ...], ...]:
        """Each group's senders in stripe order (one group unless ``groups``); empty when not dealt into stripes."""
        if self.stripes == 1:
            return ()
        return tuple(tuple(self.senders[g * self.stripes:(g + 1) * self.stripes]) for g in range(self.groups))


@dataclass(frozen=True, kw_only=True)
class PhaseTiming:
    """Seconds spent in one phase of the pipeline on one worker (busy time, not wall time: pack, publish, receive,
    unpack — a receiver's consumer with a bucket in hand, reading, copying and hashing it — and for a staged update's
    stager its staging)."""

    phase: str
    seconds: float


@dataclass(frozen=True, kw_only=True)
class TransferReport:
    """What one worker did in one update: returned by ``send_weights`` and by a finished ``receive_weights``.

    ``digest`` is the end-to-end digest over every bucket's tensor metadata (names, dtypes, shapes, ranges) and
    bytes, in order; a receiver's equals its sender's exactly when it received what was sent. A receiver that
    verified its part alone (``part`` >= 0, ``weightsync.api.parts``) reports the digest of the update whose part
    it checked against what the sender sent of that part.
    """

    role: Role
    rank: int
    version: int
    nbytes: int
    tensors: int
    buckets: int
    seconds: float
    digest: str
    sender: int = 0
    """For a receiver: the actor rank whose stream this report covers."""
    phases: tuple[PhaseTiming, ...] = ()
    finalized: bool = False
    """The worker already ran the engine's ``finalize`` after this transfer (a host that does so in the same call
    spares the manager a round trip); False: the manager calls ``finalize`` on it."""
    wire_bytes: int = 0
    """Payload bytes that crossed to (a receiver) or were published for (a sender) each receiver: ``nbytes`` for a
    full update, the encoded changes (and any bucket sent dense) for a delta update."""
    changed_bytes: int = 0
    """A sender's: bytes of tensor data that differ from the previous version it sent (``nbytes`` when it kept
    none), counted when the sender keeps that version (``SyncConfig.delta``); 0 otherwise."""
    base: int = -1
    """The version this update's deltas applied to; -1 for a full update."""
    delta_buckets: int = 0
    """A receiver's: buckets that arrived as changes against ``base`` (the others arrived dense, every byte)."""
    part: int = -1
    """A receiver's: the part it verified (its index in the senders' plan), or -1 when it verified every byte."""
    part_bytes: int = -1
    """A receiver's that verified its part: the bytes of its part it read and hashed (-1 otherwise)."""
    model: str = ""
    """A sender's that keeps the version it sent (``SyncConfig.delta``): that version's model digest (keyed sums of
    every tensor in its buckets, whether this update carried changes or every byte); "" otherwise. Two senders of
    the same version in the same buckets report the same one (a peer that serves a catch-up is checked by it). A
    peer serving the update its host staged (``SyncConfig.staged`` without delta) reports the stream digest it was
    staged under (its bytes hashed again as they were read), checked against the actor worker group's ``digest``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferReport:
        """The report ``to_dict`` gave (``phases`` as plain mappings)."""
        fields = dict(data)
        fields["phases"] = tuple(PhaseTiming(**phase) for phase in fields.get("phases", ()))
        return cls(**fields)


Received: TypeAlias = Literal["full", "changes"]
"""What an update sent a replica (``ReplicaOutcome.received``)."""

ReplicaState: TypeAlias = Literal["committed", "torn", "untouched", "evicted"]
"""``committed``: every worker holds the new version, digests verified. ``torn``: the update reached some of its
bytes but not verifiably all; the replica stays paused until an update repairs it. ``untouched``: the update failed
before any byte reached it; it holds its previous version intact."""


@dataclass(frozen=True, kw_only=True)
class ReplicaOutcome:
    replica: int
    state: ReplicaState
    version: int | None
    """The version the replica holds now (None when torn or never updated)."""
    resumed: bool
    error: str | None = None
    received: Received = "full"
    """``full``: the update sent this replica every byte (a full update, or a delta update whose every bucket went
    dense); ``changes``: some of its buckets arrived as only what changed since the version the replica held."""
    pause_seconds: float = 0.0
    """How long the update kept this replica from serving, from its pause to its resume, as the manager timed it:
    an unstaged update's transfer, verification and resume (any setup ran before the pause, the replica serving); a
    staged one's swap (0.0 for a replica it never paused: its staging failed and it went on serving its old
    version). A replica left paused (torn) counts until the update returned."""
    stage_seconds: float = 0.0
    """Staged updates (``SyncConfig.staged``): from the start of the update until every host of this replica held a
    verified staged copy (or its staging failed), the replica serving meanwhile."""
    swap_seconds: float = 0.0
    """Staged updates: the apply from staging into the live parameters, on all of the replica's workers."""


@dataclass(frozen=True, kw_only=True)
class StagedUpdate:
    """Where a host's stager left one staged update (``SyncConfig(staged=True)``): what every rollout worker of that
    host reads in the swap. Plain data; the manager hands a stager's answer to the host's other workers."""

    area: str
    """The staging area: a shared-memory segment (``/dev/shm`` name) on the stager's host."""
    size: int
    """Bytes of the segment (a reader maps this many)."""
    version: int
    epoch: str
    """The membership epoch the update was staged in (its headers carry it)."""
    records: int
    """Buckets and markers staged, the final header included."""
    nbytes: int
    """Bytes of the area in use."""
    node_id: str = ""
    """The stager's host."""
    report: TransferReport | None = None
    """The stager's receive: its digest is of the staged bytes, checked against the sender's."""
    stripes: tuple[StagedUpdate, ...] = ()
    """An update dealt into K stripes and staged by K stagers of the host, one stripe each, into an area each: every
    stripe's ``StagedUpdate``, in stripe order (a swap reads them all, bucket by bucket in bucket order). The fields
    above are then stripe 0's, except ``report``, the whole update's: its digest combines the stripes'. Empty for an
    update staged whole."""
    sources: tuple[int, ...] = ()
    """From a sharded ``actor_wg`` (``weightsync.api.sources``): the senders whose streams were staged, in the order
    their digests combine (a swap folds each bucket into its sender's); empty: one sender."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data (nested dicts, lists), for a channel that carries no weightsync types."""
        return {**{item.name: getattr(self, item.name) for item in dataclasses.fields(self)},
                "report": self.report.to_dict() if self.report is not None else None,
                "stripes": [part.to_dict() for part in self.stripes]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StagedUpdate:
        """The staged update ``to_dict`` gave."""
        fields = dict(data)
        report = fields.get("report")
        fields["report"] = TransferReport.from_dict(report) if report is not None else None
        fields["stripes"] = tuple(cls.from_dict(part) for part in fields.get("stripes", ()))
        fields["sources"] = tuple(fields.get("sources", ()))
        return cls(**fields)


@dataclass(frozen=True, kw_only=True)
class UpdateReport:
    """The manager's account of one ``update_weights`` call."""

    version: int
    backend: str
    """The backend that ran (with ``backend="auto"``, the one it picked: ``chosen`` says its layout and why)."""
    nbytes: int
    """The model's size: bytes of weights each receiver holds from this update (also for a delta update)."""
    seconds: float
    """Wall time of the whole update, any setup included."""
    stages: Mapping[str, float] = field(default_factory=dict)
    """Wall seconds per manager step: health (the ping before it), setup (when this update built its epoch), pause,
    transfer, verify_load, finalize, resume; after replicas died during it, evict (the ping that found them) and
    the second transfer's steps as retry_<step>."""
    digest: str = ""
    receivers: int = 0
    replicas: tuple[ReplicaOutcome, ...] = ()
    evicted: tuple[ReplicaOutcome, ...] = ()
    """The replicas this update evicted (``state == "evicted"``; ``replica``: its index before the update, ``error``:
    why): dead before it began or during it, so left out of it and of the manager's membership
    (``SyncConfig.max_evicted``)."""
    joined: tuple[ReplicaOutcome, ...] = ()
    """The replicas added since the last update that caught up from a peer before it (``replica``: its index now):
    ``committed`` (they then took this update as everyone did, a delta where it was one) or ``torn`` (the catch-up
    failed, ``error`` says why: never resumed by it, this update sent them, and so everyone, in full)."""
    transfers: tuple[TransferReport, ...] = ()
    rebuilt: bool = False
    """Whether this update (re)built the topology (first update, membership change, or after a failure)."""
    chosen: str = ""
    """With ``backend="auto"``: the backend it picked at the last setup, its layout and why (e.g. ``"nixl
    (two-level): workers on 3 hosts: the fastest network transport installed"``); empty for a named backend."""
    wire_bytes: int = 0
    """Payload bytes sent per receiver: ``nbytes`` for a full update, the encoded changes for a delta update."""
    changed_fraction: float = 1.0
    """Bytes of the model that differ from the previous version, over ``nbytes`` (1.0 when not compared: a
    sender without ``SyncConfig.delta`` keeps no previous version)."""

    @property
    def transfer_seconds(self) -> float:
        return float(self.stages.get("transfer", self.seconds))

    @property
    def gbps_per_receiver(self) -> float:
        """Decimal GB/s each receiver got during the transfer step."""
        seconds = self.transfer_seconds
        return self.nbytes / seconds / 1e9 if seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return all(outcome.state == "committed" for outcome in self.replicas)

    @property
    def pause_seconds(self) -> float:
        """The longest any replica was kept from serving (``ReplicaOutcome.pause_seconds``)."""
        return max((outcome.pause_seconds for outcome in self.replicas), default=0.0)

    def metrics(self, prefix: str = "weightsync/") -> dict[str, float]:
        """The update as flat numbers, for a trainer's logger as they are (verl's metrics, wandb, TensorBoard):
        its version, sizes (``bytes``: the model each receiver holds; ``wire_bytes``: what was sent per receiver),
        seconds (the whole update and each step, ``<step>_seconds``), the longest pause (``pause_s_max``), the
        replicas by state, and whether it rebuilt the topology."""
        states = [outcome.state for outcome in (*self.replicas, *self.evicted)]
        flat = {
            "version": float(self.version), "update_seconds": self.seconds, "bytes": float(self.nbytes),
            "wire_bytes": float(self.wire_bytes), "changed_fraction": self.changed_fraction,
            "gbps_per_receiver": self.gbps_per_receiver, "receivers": float(self.receivers),
            "pause_s_max": self.pause_seconds, "topology_rebuilt": 1.0 if self.rebuilt else 0.0,
            **{f"replicas_{state}": float(states.count(state)) for state in get_args(ReplicaState)},
            "transfer_seconds": self.transfer_seconds,
            **{f"{step}_seconds": float(seconds) for step, seconds in self.stages.items()},
        }
        return {prefix + key: value for key, value in flat.items()}


def json_safe(value: Any) -> JsonValue:
    """Return ``value`` as JSON-like data, converting tuples to lists; raise ``TypeError`` on anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    if isinstance(value, Mapping):
        out: dict[str, JsonValue] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"mapping key {key!r} is not a string")
            out[key] = json_safe(item)
        return out
    raise TypeError(f"{type(value).__name__} is not plain data")
