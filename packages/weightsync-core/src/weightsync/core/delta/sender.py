"""A sender's side of delta updates: the version it keeps on the host (the base of the next update), and per update
the compare-and-encode of each bucket against it, the kept copy brought up to the new version, and the model digest
folded from the kept buckets' keyed sums (the format: :mod:`weightsync.core.delta.encoding`)."""

from __future__ import annotations

import array
import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weightsync.core.delta import encoding
from weightsync.core.delta.copies import BaseCopies, BucketCopy
from weightsync.core.delta.parts import MAX_PARTS, PartWords, part_segments
from weightsync.core.native import copy_batch
from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.digest import UpdateDigest
from weightsync.core.wire.layout import PlannedBucket, pack_hashing
from weightsync.core.wire.parts import PartLayout

__all__ = ["DeltaUpdate", "SenderDelta"]

_MASK = (1 << 64) - 1


class Gathered:
    """A bucket's pieces packed block after block (``weightsync.core.wire.blocks``), gathered in that order: the
    encoder compares a piece with the kept copy in the bucket's layout. One host buffer, grown as needed."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def gather(self, bucket: PlannedBucket) -> dict[int, int]:
        """Gather the bucket's blocked pieces; where each now lies, by its bucket offset."""
        blocked = [(meta, source) for meta, source, _ in bucket.large
                   if meta.blocks and meta.bucket_offset in bucket.rows]
        if not blocked:
            return {}
        need = sum(meta.nbytes for meta, _ in blocked)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=torch.uint8)
        at, places = self._buffer.data_ptr(), {}
        for meta, source in blocked:
            for triples, _ in bucket.rows[meta.bucket_offset]:
                copy_batch(triples, at, source.data_ptr())
            places[meta.bucket_offset] = at
            at += meta.nbytes
        return places


@dataclass
class SenderDelta:
    """What a sender keeps across updates (``SyncConfig.delta``)."""

    kept: BaseCopies = field(default_factory=BaseCopies)
    """The last version this sender sent, on the host, bucket by bucket."""
    allowed_base: int | None = None
    """The version every receiver holds, as the manager said at ``init_process_group`` (advanced by every update
    this epoch completes); None: send the next update full."""

    gathered: Gathered = field(default_factory=Gathered)
    """Where pieces packed block after block are gathered in that order to be compared, reused across updates."""
    words: dict[tuple[bytes, int], PartWords] = field(default_factory=dict)
    """Each distinct part's held ranges, kept across updates and epochs (keyed by its regions and index)."""

    def begin(self, parts: Sequence[PartLayout] = ()) -> DeltaUpdate:
        """An update starts: against the kept version when every receiver holds it, else full (the kept copy is
        rewritten). Until it completes the kept copy holds no whole version. ``parts``: the distinct parts the
        receivers declared, whose part model digests the update folds too."""
        kept = self.kept
        usable = kept.version is not None and kept.version == self.allowed_base
        words = [PartWords.of(layout, self.words) for layout in parts]
        update = DeltaUpdate(kept, kept.version if usable and kept.version is not None else -1,
                             kept.model if usable else "", parts=words, gathered=self.gathered)
        kept.version = None
        return update

    def completed(self, update: DeltaUpdate, version: int, model: str) -> None:
        """Every receiver acknowledged every bucket of ``update``: the kept copy is ``version`` now."""
        update.kept.version, update.kept.model = version, model
        self.allowed_base = version


@dataclass
class DeltaUpdate:
    """One update of a sender that keeps its last version: against which base it encodes, and what it counted."""

    kept: BaseCopies
    base: int
    """The base version of this update's deltas, -1 for a full update (the kept copy is then rewritten)."""
    base_model: str
    changed: int = 0
    folding: list[tuple[bytes, int, concurrent.futures.Future[int]]] = field(default_factory=list)
    """Each bucket's table, size and keyed sum, in order: known for a bucket sent as changes (its kept sum updated
    by what changed), else being summed from the kept copy on the digest thread."""
    parts: list[PartWords] = field(default_factory=list)
    """The distinct parts the receivers declared, each of whose part model digest this update folds too
    (:mod:`weightsync.core.delta.parts`)."""
    part_folding: list[list[concurrent.futures.Future[int]]] = field(default_factory=list)
    """Per bucket, in order, each part's keyed sum of its held ranges: known for a bucket sent as changes (the
    encoder updated it from the words that changed), else being summed from the kept copy on the digest thread."""
    part_models: list[str] = field(default_factory=list)
    """Once :meth:`model_digest` ran: each part's model digest, in the order of the senders' plan."""
    gathered: Gathered = field(default_factory=Gathered)
    """The sender's buffer for pieces packed block after block (:class:`Gathered`)."""

    def pack(self, buffer: torch.Tensor, bucket: PlannedBucket, table: bytes, digest: UpdateDigest, *, index: int,
             pool: concurrent.futures.ThreadPoolExecutor) -> tuple[int, int]:
        """Bucket ``index`` into the host ``buffer``: its changes against the kept bucket when that lines up and
        they are smaller than the bucket, else the bucket dense; either way the kept bucket becomes this version's
        and is folded into the model digest (on ``pool``, which also compares half of a large bucket). Returns the
        bytes to publish and the header's ``dense`` (the dense size for changes, -1 for a dense bucket)."""
        base, dense = buffer.data_ptr(), -1
        kept = self.kept.match(index, table, bucket.nbytes) if self.base >= 0 and bucket.nbytes else None
        length: int | None = None
        if kept is not None:
            rows = array.array("Q")
            kept_at = kept.data.data_ptr()
            blocked = self.gathered.gather(bucket)
            for meta, source, start in bucket.items:
                rows.extend((blocked.get(meta.bucket_offset, source.data_ptr() + start), kept_at + meta.bucket_offset,
                             meta.nbytes, encoding.unit_of(meta), encoding.piece_key(index, meta.bucket_offset)))
            segments = (self._segments(kept, [meta for meta, _, _ in bucket.items])
                        if 0 < len(self.parts) <= MAX_PARTS else None)
            length, changed, sum_change, part_changes = encoding.encode(
                rows, base, bucket.nbytes - 1, pool, segments=segments, parts=len(self.parts) if segments else 0)
            self.changed += changed
            if kept.total is not None:
                kept.total = (kept.total + sum_change) & _MASK
            # The sums the encoder kept up to date; any other part's (none without segments) is summed again.
            kept.part_totals = {part.key: (kept.part_totals[part.key] + part_change) & _MASK
                                for part, part_change in zip(self.parts, part_changes) if part.key in kept.part_totals}
        if kept is not None and length is not None:
            dense = bucket.nbytes
            digest.update_bucket(table, buffer[:length])
        else:
            length = bucket.nbytes
            digest.begin_bucket(table, bucket.nbytes)
            pack_hashing(base, bucket, digest)
            if kept is None:  # the kept bucket is rewritten from the packed one (its padding stays zero)
                kept = self.kept.replace(index, table, bucket.nbytes)
                copy_batch([item for meta, _, _ in bucket.items for item in (meta.bucket_offset, meta.bucket_offset,
                                                                             meta.nbytes)],
                           kept.data.data_ptr(), base)
                self.changed += bucket.payload_bytes
        self._fold(pool, index, bucket, table, kept)
        return length, dense

    def _fold(self, pool: concurrent.futures.ThreadPoolExecutor, index: int, bucket: PlannedBucket, table: bytes,
              kept: BucketCopy) -> None:
        """Fold ``kept`` (final for this version) into the model digest: its sum now when known, else on ``pool``
        while the next bucket is packed."""
        future = (_known(kept.total) if kept.total is not None
                  else pool.submit(kept.sum, index, [meta for meta, _, _ in bucket.items]))
        self.folding.append((table, kept.nbytes, future))
        if self.parts:
            metas = [meta for meta, _, _ in bucket.items]
            self.part_folding.append([_known(kept.part_totals[part.key]) if part.key in kept.part_totals
                                      else pool.submit(_part_sum, kept, part, index, metas) for part in self.parts])

    def _segments(self, kept: BucketCopy, metas: Sequence[TensorMeta]) -> array.array[int]:
        """The encoder's segments for ``kept``'s pieces ``metas`` and this update's parts, kept with the bucket."""
        key = tuple(part.key for part in self.parts)
        if kept.segments is None or kept.segments[0] != key:
            kept.segments = (key, part_segments(self.parts, metas))
        return kept.segments[1]

    def model_digest(self, buckets: int) -> str:
        """Once every one of the update's ``buckets`` is folded: the model digest (the kept copy loses any bucket
        past them: the model got smaller)."""
        model = encoding.ModelDigest()
        by_part = [encoding.ModelDigest() for _ in self.parts]
        for (table, nbytes, future), sums in zip(self.folding, self.part_folding or [[]] * len(self.folding)):
            model.add(table, nbytes, future.result())
            for part_model, part_sum in zip(by_part, sums):
                part_model.add(table, nbytes, part_sum.result())
        self.folding, self.part_folding = [], []
        self.part_models = [""] * (max((part.index for part in self.parts), default=-1) + 1)
        for part, part_model in zip(self.parts, by_part):
            self.part_models[part.index] = part_model.hexdigest()
        self.kept.truncate(buckets)
        return model.hexdigest()

    def settle_quietly(self) -> None:
        """After a failed update: the sums under way finish before anything changes the kept copy (no kept bucket
        may change or go while one reads it); their errors do not matter, the update failed already."""
        folding, self.folding = self.folding, []
        futures = [future for _, _, future in folding] + [future for sums in self.part_folding for future in sums]
        self.part_folding = []
        for future in futures:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the model digest of a failed update is discarded
                pass


def _known(total: int) -> concurrent.futures.Future[int]:
    """A sum known already, as the digest thread's sums are awaited."""
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.set_result(total)
    return future


def _part_sum(kept: BucketCopy, part: PartWords, index: int, metas: Sequence[TensorMeta]) -> int:
    """``part``'s keyed sum of ``kept`` (bucket ``index``, pieces ``metas``), remembered with the bucket: the encoder
    keeps it up to date from then on."""
    total = kept.part_totals[part.key] = part.bucket_sum(index, metas, kept.data)
    return total
