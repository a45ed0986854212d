"""The pure part of the ``kimi`` backend: its options, the ParameterServer world and each worker's place in it,
who owns which tensor, and the digest.

Kept free of checkpoint-engine and of devices so that all of it is tested on any machine.

The digest
----------
checkpoint-engine re-buckets the weights itself (bucket sizes follow free device memory), so receivers cannot
reproduce the sender's bucket sequence and the pipeline's ordered digest does not apply. Instead each tensor gets an
XXH3-128 hash of its name, dtype, shape and bytes, and a set of tensors hashes to the **sum of its tensors' hashes
modulo 2^128**: independent of order and of bucketing, and additive, so the whole model's digest is the sum of the
actor ranks' share digests. The sum travels as four 32-bit limbs in an ``int64`` all-reduce over the
ParameterServer's own group (no pickle, no extra connection); limb sums cannot overflow below 2^31 ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec
import torch
import xxhash

from weightsync.api.errors import ConfigError, TopologyError
from weightsync.api.types import RankArgs, Topology, WorldMetadata
from weightsync.core.backend import (
    EngineMetadata, RankPlan, RankRole, as_byte_view, decode_metadata, dtype_name, encode_plan, memoryview_of,
    validate_pair)

__all__ = [
    "MODES",
    "Weights",
    "KimiOptions",
    "JoinArgs",
    "KimiMetadata",
    "KimiPlan",
    "KimiReceive",
    "KimiSend",
    "parameter_server_topology",
    "ShareAssigner",
    "collect_share",
    "ps_rank",
    "SetDigest",
    "Exchange",
    "EXCHANGE_WIDTH",
]

MODES = ("broadcast", "p2p")
_MASK = (1 << 128) - 1
_LIMB = (1 << 32) - 1
EXCHANGE_WIDTH = 7
"""Values each rank contributes to the all-reduce: four digest limbs, tensor count, bytes, update version."""


Weights = list[tuple[str, torch.Tensor]]
"""One bucket as checkpoint-engine hands it to the IPC callback: views into its device buffer."""


def ps_rank(*, role: str, rank: int, actor_wg_world_size: int) -> int:
    """The ParameterServer rank of a worker: actor ranks first, then rollout workers (verl's layout)."""
    return rank if role == "actor" else actor_wg_world_size + rank


@dataclass(frozen=True)
class KimiOptions:
    """The backend's own options (see the README); :meth:`parse` raises ``ConfigError`` for a bad one."""

    NAMES: ClassVar[frozenset[str]] = frozenset({"mode", "mem_fraction", "shared_memory_pool"})

    mode: str = "broadcast"
    mem_fraction: float | None = None
    """Share of free device memory for checkpoint-engine's buffers; None: its own default."""
    shared_memory_pool: bool = True
    """Reuse one pinned pool across updates (shares of a stable size)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> KimiOptions:
        mode = options.get("mode", "broadcast")
        if mode not in MODES:
            raise ConfigError(f"kimi: mode must be one of {', '.join(MODES)}, got {mode!r}")
        mem_fraction = options.get("mem_fraction")
        if mem_fraction is not None and (isinstance(mem_fraction, bool) or not isinstance(mem_fraction, float)
                                         or not 0 < mem_fraction <= 1):
            raise ConfigError(f"kimi: mem_fraction must be a float in (0, 1], got {mem_fraction!r}")
        shared = options.get("shared_memory_pool", True)
        if not isinstance(shared, bool):
            raise ConfigError(f"kimi: shared_memory_pool must be a bool, got {shared!r}")
        return cls(mode=str(mode), mem_fraction=mem_fraction, shared_memory_pool=shared)


class KimiMetadata(EngineMetadata, kw_only=True, frozen=True):
    """What a kimi worker advertises: its mode; actor rank 0 also where the ParameterServer's store will listen."""

    mode: str = "broadcast"
    master_addr: str = ""
    master_port: int = 0


class JoinArgs(RankPlan, tag="kimi", frozen=True):
    """One worker's plan: its place in the ParameterServer world of one epoch (:class:`KimiSend` for an actor rank,
    :class:`KimiReceive` for a rollout worker)."""

    ps_rank: int
    ps_world_size: int
    master_addr: str
    master_port: int
    actor_wg_world_size: int
    mode: str = "broadcast"
    update_ranks: list[int] = msgspec.field(default_factory=list)
    """The PS ranks ``update`` serves (``p2p``: the rollout workers); empty: every rank (``broadcast``)."""

    @property
    def checkpoint_name(self) -> str:
        """The name this epoch's shares are registered under with the ParameterServer."""
        return f"weightsync-{self.epoch[:16]}"


class KimiSend(JoinArgs, tag="kimi-send", frozen=True):
    """An actor rank: it registers its share of the update with the ParameterServer."""

    role: ClassVar[RankRole] = "sender"


class KimiReceive(JoinArgs, tag="kimi-receive", frozen=True):
    """A rollout worker: the ParameterServer's ``update`` delivers the whole update to it."""

    role: ClassVar[RankRole] = "receiver"


KimiPlan = KimiSend | KimiReceive


def parameter_server_topology(
    *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata
) -> Topology:
    """Every worker of the epoch in one ParameterServer world; actor rank 0 hosts its store (see ``prepare``)."""
    if actor_wg_world_size < 1 or rollout_world_size < 0:
        raise TopologyError(f"kimi: need actor_wg_world_size >= 1 and rollout_world_size >= 0, got "
                            f"{actor_wg_world_size} and {rollout_world_size}")
    if len(metadata.actor) != actor_wg_world_size or len(metadata.rollout) != rollout_world_size:
        raise TopologyError("kimi: metadata does not match actor_wg_world_size/rollout_world_size")
    entries = [decode_metadata(entry, KimiMetadata, who=f"kimi {role} rank {rank}")
               for role, group in (("actor", metadata.actor), ("rollout", metadata.rollout))
               for rank, entry in enumerate(group)]
    modes = {entry.mode for entry in entries}
    if len(modes) != 1:
        raise TopologyError(f"kimi: workers disagree on the mode option: {sorted(modes)}")
    mode, first = modes.pop(), entries[0]
    if not first.master_addr or not first.master_port:
        raise TopologyError("kimi: actor rank 0 did not advertise master_addr/master_port (was prepare() called?)")

    update_ranks = [ps_rank(role="rollout", rank=j, actor_wg_world_size=actor_wg_world_size)
                    for j in range(rollout_world_size)] if mode == "p2p" else []

    def plan(kind: type[JoinArgs], role: str, rank: int) -> RankArgs:
        return encode_plan(kind(
            ps_rank=ps_rank(role=role, rank=rank, actor_wg_world_size=actor_wg_world_size),
            ps_world_size=actor_wg_world_size + rollout_world_size, master_addr=first.master_addr,
            master_port=first.master_port, actor_wg_world_size=actor_wg_world_size, mode=mode,
            update_ranks=update_ranks))

    actor = [plan(KimiSend, "actor", i) for i in range(actor_wg_world_size)]
    rollout = [plan(KimiReceive, "rollout", j) for j in range(rollout_world_size)]
    # Every actor rank sends a disjoint share; each reports the digest of the whole update (after the exchange).
    return Topology(actor=actor, rollout=rollout, senders=tuple(range(actor_wg_world_size)))


class ShareAssigner:
    """Splits the weights stream among actor ranks: each tensor goes to the least-loaded rank (by bytes so far).

    Every actor rank drains the same stream in the same order, so every rank computes the same assignment without
    talking to the others; the shares are disjoint and cover the stream.
    """

    def __init__(self, *, actor_wg_world_size: int) -> None:
        if actor_wg_world_size < 1:
            raise TopologyError(f"kimi needs at least one actor rank, got actor_wg_world_size={actor_wg_world_size}")
        self._loads = [0] * actor_wg_world_size

    def owner(self, nbytes: int) -> int:
        rank = min(range(len(self._loads)), key=lambda index: (self._loads[index], index))
        # A zero-byte tensor still costs a slot in the owner's table: count it as one byte so they spread out.
        self._loads[rank] += max(nbytes, 1)
        return rank


async def collect_share(
    weights: Iterable[object], *, rank: int, actor_wg_world_size: int, devices: frozenset[str]
) -> tuple[dict[str, torch.Tensor], SetDigest]:
    """Drain the whole stream (gathering may be collective); keep and hash actor rank ``rank``'s share on the host."""
    assigner = ShareAssigner(actor_wg_world_size=actor_wg_world_size)
    seen: set[str] = set()
    share: dict[str, torch.Tensor] = {}
    digest = SetDigest()
    for count, item in enumerate(weights, start=1):
        name, tensor = validate_pair(item, devices=devices, seen=seen)
        if assigner.owner(tensor.numel() * tensor.element_size()) == rank:
            host = tensor.detach().to("cpu", copy=True).contiguous()
            share[name] = host
            digest.add(name, host)
        if count % 64 == 0:  # let the event loop breathe while a long stream is drained
            await asyncio.sleep(0)
    return share, digest


@dataclass
class SetDigest:
    """The order-independent digest of a set of tensors (see the module docstring)."""

    value: int = 0
    tensors: int = 0
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        data = as_byte_view(tensor.detach().cpu())
        hasher = xxhash.xxh3_128()
        table = f"{name}\0{dtype_name(tensor.dtype)}\0{tuple(int(d) for d in tensor.shape)}".encode()
        hasher.update(len(table).to_bytes(8, "little"))
        hasher.update(table)
        if data.numel():
            hasher.update(memoryview_of(data))
        self.value = (self.value + hasher.intdigest()) & _MASK
        self.tensors += 1
        self.nbytes += data.numel()

    def hexdigest(self) -> str:
        return f"{self.value:032x}"


@dataclass(frozen=True)
class Exchange:
    """What every ParameterServer rank learns from the all-reduce: the whole update's digest, size and version."""

    digest: str
    tensors: int
    nbytes: int
    version: int

    @staticmethod
    def contribution(share: SetDigest | None, *, version: int | None) -> list[int]:
        """This rank's values; receivers contribute zeros, and only actor rank 0 contributes the version."""
        value = share.value if share is not None else 0
        limbs = [(value >> (32 * index)) & _LIMB for index in range(4)]
        return [*limbs, share.tensors if share else 0, share.nbytes if share else 0, version or 0]

    @staticmethod
    def from_sum(values: Sequence[int]) -> Exchange:
        if len(values) != EXCHANGE_WIDTH or any(not isinstance(v, int) or v < 0 for v in values):
            raise TopologyError(f"kimi digest exchange returned {list(values)!r}")
        total = sum(limb << (32 * index) for index, limb in enumerate(values[:4])) & _MASK
        return Exchange(digest=f"{total:032x}", tensors=values[4], nbytes=values[5], version=values[6])
