"""A sharded ``actor_wg`` (:mod:`weightsync.api.sources`): who sends what, checked before any replica is paused, and
the receiver that reads every sender's stream.

**The plan** (:func:`plan_sources`, from every actor rank's declared :class:`~weightsync.api.sources.SourceLayout`):
every actor rank that holds bytes of the model sends them, at once, each its own stream. A range of a tensor held by
several ranks (a replicated tensor; the same shard on several replicas of a hybrid mesh) is sent by one of them, the
others leaving the tensor out (``RankPlan.skip``; the holders take turns tensor by tensor). Checked, each a
``TopologyError`` naming the tensor: shapes the ranks disagree on, a box that is not one contiguous range of rows,
two ranks holding overlapping but different ranges, and a range a rollout worker needs (the whole tensor, or the
regions of its declared part) that no rank holds.

**The receiver** (:class:`SourcesReceiver`): one ``ReceiverTransport`` over every sender's stream, taking a bucket from
each sender in turn, or, over the network, from whichever stream delivered first (the senders stream the model in the
same order, so a tensor's ranges arrive close together),
then one final header once every sender has ended its stream: the senders' digests combined in their order
(:func:`~weightsync.core.wire.sources.combine_sources`), each part's sums one sender's after another, and each
sender's end (``ends``: its buckets, base and model digest, what a delta receiver checks per sender).
"""

from __future__ import annotations

import math
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from weightsync.api.errors import ConfigError, TopologyError, TransferError, WireError
from weightsync.api.parts import PART_KEY, Region
from weightsync.api.sources import SOURCE_KEY, SourceLayout, byte_range
from weightsync.api.types import WorkerMetadata, WorldMetadata
from weightsync.core.transports.chain.stripes import Interleaved, ReadAhead
from weightsync.core.transports.seam import ReceivedBucket, ReceiverTransport
from weightsync.core.wire import codec
from weightsync.core.wire.partplans import PartPlan, declared_parts
from weightsync.core.wire.parts import byte_runs
from weightsync.core.wire.sources import combine_sources

__all__ = ["SourcesPlan", "SourcesReceiver", "plan_sources"]


@dataclass(frozen=True)
class SourcesPlan:
    """Who sends what of a sharded ``actor_wg``'s update."""

    senders: tuple[int, ...]
    """The actor ranks that send, in rank order (every receiver reads them all; the digest combines theirs so)."""
    skip: dict[int, tuple[str, ...]]
    """Per sender: the tensors it holds and leaves to another holder."""


def declared_layouts(actor: Sequence[WorkerMetadata]) -> list[SourceLayout] | None:
    """Every actor rank's declared layout, or None where none declared one (the ``actor_wg`` is not sharded); a
    ``TopologyError`` naming the rank whose layout is missing or malformed."""
    declared = [entry.get(SOURCE_KEY) for entry in actor]
    if all(layout is None for layout in declared):
        return None
    layouts = []
    for rank, layout in enumerate(declared):
        if layout is None:
            raise TopologyError(f"actor rank {rank} declared no source layout while others did: every rank of a "
                                "sharded actor_wg says what it holds", field=f"$.{SOURCE_KEY}")
        try:
            layouts.append(SourceLayout.from_dict(layout))  # type: ignore[arg-type]
        except ConfigError as exc:
            raise TopologyError(f"actor rank {rank}: {exc}", field=f"$.{SOURCE_KEY}") from None
    return layouts


def plan_sources(metadata: WorldMetadata) -> SourcesPlan | None:
    """The plan of a sharded ``actor_wg`` (module docstring), or None where no actor rank declared a layout."""
    layouts = declared_layouts(list(metadata.actor))
    if layouts is None:
        return None
    parts = declared_parts(metadata.rollout, [f"rollout rank {rank}" for rank in range(len(metadata.rollout))])
    names = list(dict.fromkeys(name for layout in layouts for name in layout.tensors))
    sending: set[int] = set()
    skip: dict[int, list[str]] = {rank: [] for rank in range(len(layouts))}
    for turn, name in enumerate(names):
        held = [(rank, layout.tensors[name]) for rank, layout in enumerate(layouts) if name in layout.tensors]
        shape = held[0][1].shape
        ranges: dict[tuple[int, int], list[int]] = {}
        for rank, holding in held:
            if holding.shape != shape:
                raise TopologyError(f"actor ranks {held[0][0]} and {rank} hold {name!r} with shapes {shape} and "
                                    f"{holding.shape}")
            where = byte_range(shape, holding.region)
            if where is None:
                raise TopologyError(f"actor rank {rank} holds a block of {name!r} that is not one contiguous range of "
                                    f"its rows ({holding.region}): not built (sharded sources send Shard(0) blocks)")
            if where[1] > where[0] or not math.prod(shape):  # an empty shard sends nothing
                ranges.setdefault(where, []).append(rank)
        chosen = _chosen(name, ranges, turn)
        for where, holders in ranges.items():
            for rank in holders:
                if rank == chosen[where]:
                    sending.add(rank)
                else:
                    skip[rank].append(name)
        _check_covered(name, shape, sorted(chosen), parts)
    senders = tuple(sorted(sending))
    if not senders:
        raise TopologyError("no actor rank holds any bytes of the model")
    return SourcesPlan(senders=senders, skip={rank: tuple(skip[rank]) for rank in senders})


def _chosen(name: str, ranges: dict[tuple[int, int], list[int]], turn: int) -> dict[tuple[int, int], int]:
    """Which holder sends each range of ``name`` (holders of the same range take turns); a ``TopologyError`` where
    two ranges overlap without being the same."""
    ordered = sorted(ranges)
    for (first, end), (low, high) in zip(ordered, ordered[1:]):
        if low < end:
            raise TopologyError(f"actor ranks {ranges[(first, end)][0]} and {ranges[(low, high)][0]} hold overlapping, "
                                f"different elements of {name!r} ([{first}, {end}) and [{low}, {high})): not built")
    return {where: holders[(turn + index) % len(holders)] for index, (where, holders) in enumerate(ranges.items())}


def _check_covered(name: str, shape: tuple[int, ...], ranges: list[tuple[int, int]],
                   parts: Sequence[PartPlan | None]) -> None:
    """A ``TopologyError`` naming ``name`` and a rollout worker whose part's region of it does not fit its shape, or
    that needs elements no chosen range holds."""
    numel = math.prod(shape)
    for rank, part in enumerate(parts):
        for start, size in (part.tensors.get(name) or ()) if part is not None else ():
            if not Region(start=tuple(start), size=tuple(size)).fits(shape):
                raise TopologyError(f"rollout rank {rank} declared a region start={tuple(start)} size={tuple(size)} "
                                    f"of {name!r}, which does not fit its shape {shape}", field=f"$.{PART_KEY}")
    gaps, reached = [], 0
    for first, end in ranges:
        if first > reached:
            gaps.append((reached, first))
        reached = max(reached, end)
    if reached < numel:
        gaps.append((reached, numel))
    if not gaps:
        return
    for rank, part in enumerate(parts):
        boxes = part.tensors.get(name) if part is not None else None
        if boxes is None:
            needed: list[tuple[int, int]] = [(0, numel)]
        else:
            starts, ends = byte_runs(boxes, shape, 1, name=name)
            needed = list(zip(starts, ends))
        for low, high in needed:
            missing = next(((max(low, a), min(high, b)) for a, b in gaps if max(low, a) < min(high, b)), None)
            if missing is not None:
                raise TopologyError(f"rollout rank {rank} needs elements [{missing[0]}, {missing[1]}) of {name!r} "
                                    f"(of {numel}), which no actor rank holds")


class SourcesReceiver(Interleaved):
    """One ``ReceiverTransport`` over several senders' streams (``sources[i]`` is ``senders[i]``'s), read in turn: a
    bucket from each sender that has not ended its stream, then the merged final header (module docstring).

    Tokens as ``Interleaved`` hands them out. An abort from any source is handed on as it is.

    With ``routes`` (sources that pull their bytes inside ``receive``, over the network: a chain's), every source is
    read by a thread of its own (``ReadAhead``) from an update's first ``receive`` to its marker, so the streams move
    at once, each as far ahead as its ring allows, and a bucket is taken from whichever stream delivered first (each
    stream's in its order): a stream that is a bucket ahead never waits for another's, so no sender's link idles
    behind another's; ``routes[i]``: source i's rail and hosts when read over the network (None in place), which its
    errors then name."""

    def __init__(self, sources: Sequence[ReceiverTransport], senders: Sequence[int], *, epoch: str,
                 routes: Sequence[tuple[int, list[str]] | None] | None = None) -> None:
        if not sources or len(sources) != len(senders):
            raise ValueError("a receiver of several senders needs one source per sender")
        self._sources, self._senders, self._epoch = list(sources), list(senders), epoch
        self.capacity = max(source.capacity for source in self._sources)
        self._finals: dict[int, tuple[codec.BucketHeader, ReceivedBucket]] = {}
        self._turn = 0
        self._moving = False
        self._arrivals: queue.SimpleQueue[tuple[int, ReceivedBucket | BaseException]] = queue.SimpleQueue()
        self._ahead = [ReadAhead(source, f"the stream of actor rank {sender}", route, into=(self._arrivals, index))
                       for index, (source, sender, route) in enumerate(zip(self._sources, self._senders, routes))
                       ] if routes is not None else []

    def _next(self, deadline: float) -> tuple[int, ReceivedBucket]:
        """The next bucket and its source: in turn from sources read in place; read ahead, the first delivered."""
        if not self._ahead:
            while True:
                index = self._turn % len(self._sources)
                self._turn += 1
                if index not in self._finals:
                    return index, self._sources[index].receive(deadline)
        if not self._moving:  # an update's first receive: every stream starts moving
            self._moving = True
            for ahead in self._ahead:
                ahead.start(deadline)
        try:
            index, item = self._arrivals.get(timeout=max(deadline - time.monotonic(), 0.0) + 1.0)
        except queue.Empty:
            raise TransferError("no sender's stream delivered anything before the deadline",
                                peer=f"actor ranks {self._senders}") from None
        if isinstance(item, BaseException):
            raise item
        return index, item

    def receive(self, deadline: float) -> ReceivedBucket:
        count = len(self._sources)
        while len(self._finals) < count:
            index, received = self._next(deadline)
            if received.token != 0:
                return self._handed(received, index)
            header, _ = codec.decode_bucket(received.header, epoch=self._epoch, capacity=self.capacity)
            if header.abort or not header.final:
                return received
            if header.sender != self._senders[index]:
                raise WireError(f"actor rank {header.sender} ended the stream of actor rank {self._senders[index]}")
            self._finals[index] = header, received
        finals = [self._finals[index][0] for index in range(count)]
        last = self._finals[0][1]
        self._finals, self._turn, self._moving = {}, 0, False  # the next update starts again from the first sender
        if len({len(final.parts) for final in finals}) != 1:
            raise WireError(f"the senders' final headers carry the sums of {[len(f.parts) for f in finals]} parts")
        bases, models = {final.base for final in finals}, [final.model for final in finals]
        merged = msgspec.structs.replace(
            finals[0], index=sum(final.index for final in finals),
            digest=combine_sources([final.digest for final in finals]),
            parts=[b"".join(final.parts[at] for final in finals) for at in range(len(finals[0].parts))],
            base=bases.pop() if len(bases) == 1 else -1, model=combine_sources(models) if all(models) else "",
            ends=[codec.StreamEnd(final.sender, final.index, final.base, final.model) for final in finals])
        return ReceivedBucket(codec.encode(merged), last.payload[:0], 0)
