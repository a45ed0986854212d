"""The pure part of the ``kimi`` backend: who owns which tensor, the ParameterServer world, and the digest.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from weightsync.api.errors import TopologyError
from weightsync.core.tensors import as_byte_view, dtype_name, memoryview_of

__all__ = [
    "MODES",
    "ShareAssigner",
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


def ps_rank(*, role: str, rank: int, actor_wg_world_size: int) -> int:
    """The ParameterServer rank of a worker: actor ranks first, then rollout workers (verl's layout)."""
    return rank if role == "actor" else actor_wg_world_size + rank


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


def aligned_nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()
