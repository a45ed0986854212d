"""The chain's plan: what :func:`~weightsync.core.transports.chain.topology` and the striped topology hand each
rank (typed, decoded once where it arrives: :mod:`weightsync.core.transports.plan`), and what a chain worker
advertises in ``prepare`` for them to read (:class:`ChainMetadata`).
"""

from __future__ import annotations

from typing import ClassVar, Union

import msgspec

from weightsync.core.transports.plan import Idle, RankPlan, RankRole
from weightsync.core.transports.settings import EngineMetadata

__all__ = ["ChainMetadata", "ChainPlans", "ChainReceive", "ChainSend", "Route", "Source", "Stripe", "StreamsReceive",
           "StripesReceive"]


class ChainMetadata(EngineMetadata, kw_only=True, frozen=True):
    """What a chain worker advertises: its endpoint (``address``, ``host:port`` on its rail; empty on an actor rank
    that serves nothing) and the library that reads from it, and — read from actor rank 0's — the options that shape
    the topology (``fanout``, ``layout``, ``stripes``, ``left_out``)."""

    address: str = ""
    library: str = ""
    fanout: int = 1
    layout: str = "chain"
    stripes: int | str | list[int] = 1
    left_out: tuple[int, ...] = ()


class Stripe(msgspec.Struct, array_like=True, frozen=True):
    """Stripe ``index`` of an update dealt into ``count`` (``[s, K]`` as plain data)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"a stripe is [s, K] with 0 <= s < K, got [{self.index}, {self.count}]")


class Route(msgspec.Struct, frozen=True):
    """The rail a stripe is read over and the two hosts it crosses (errors name them)."""

    rail: int
    hosts: tuple[str, str]


class Source(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where a receiver reads one chain from, and whom it serves in turn."""

    upstream: str
    """Its upstream's endpoint (``host:port``)."""
    upstream_position: int
    """Its upstream's position (0: the sender; p: rollout rank p - 1)."""
    local: bool = False
    """The upstream is on this host: its ring is read in place, through shared memory."""
    children: tuple[int, ...] = ()
    """The positions that read from this rank."""
    in_place: tuple[int, ...] = ()
    """Those of ``children`` that read this rank's ring in place."""
    peer: str = ""
    """How errors name the upstream (empty: by its position)."""
    route: Route | None = None
    """Read over the network on a rail of a striped update: the rail and the hosts (errors name them)."""


class ChainSend(RankPlan, tag="chain-send", frozen=True):
    """A sender: the positions that read from it, and its stripe when the update is dealt into stripes."""

    role: ClassVar[RankRole] = "sender"
    children: tuple[int, ...] = ()
    in_place: tuple[int, ...] = ()
    stripe: Stripe | None = None

    @property
    def striping(self) -> tuple[int, int]:
        return (self.stripe.index, self.stripe.count) if self.stripe is not None else (0, 1)


class ChainReceive(RankPlan, tag="chain-receive", frozen=True):
    """A receiver of one chain: its rollout ``rank`` and ``source``; with ``stripe`` a stager of that one stripe of a
    staged striped update."""

    role: ClassVar[RankRole] = "receiver"
    rank: int
    source: Source
    stripe: Stripe | None = None

    @property
    def striping(self) -> tuple[int, int]:
        return (self.stripe.index, self.stripe.count) if self.stripe is not None else (0, 1)

    @property
    def one_stripe(self) -> bool:
        return self.stripe is not None


class StripesReceive(RankPlan, tag="chain-stripes", frozen=True):
    """A receiver of an update dealt into stripes: one source per stripe, in stripe order (at most one of them read
    over the network: the stripe this rank leads; the others in place from the host's leaders)."""

    role: ClassVar[RankRole] = "receiver"
    rank: int
    sources: tuple[Source, ...]

    def __post_init__(self) -> None:
        if len(self.sources) < 2:
            raise ValueError(f"a striped receiver reads two stripes or more, got {len(self.sources)}")

    @property
    def striping(self) -> tuple[int, int]:
        return 0, len(self.sources)


class StreamsReceive(RankPlan, tag="chain-streams", frozen=True):
    """A receiver of a sharded ``actor_wg``'s update: one source per sending rank's stream (``streams``, in their
    order), each read over the network where this rank leads it into its host, else in place from its leader
    (:mod:`weightsync.core.transports.chain.sources`)."""

    role: ClassVar[RankRole] = "receiver"
    rank: int
    sources: tuple[Source, ...]

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.streams) or not self.sources:
            raise ValueError(f"a receiver of {len(self.streams)} streams has {len(self.sources)} sources")


ChainPlans = Union[Idle, ChainSend, ChainReceive, StripesReceive, StreamsReceive]
"""Every plan a chain rank may be handed."""
