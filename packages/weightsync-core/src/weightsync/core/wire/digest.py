"""The end-to-end digest of one update.

Sender and every receiver fold each bucket's tensor table (names, dtypes, shapes, ranges) and payload bytes, in
bucket order, into a 128-bit XXH3 hash. Equal digests mean the receiver got exactly the bytes and layout that were
sent. XXH3 is not a cryptographic hash: it detects corruption and bugs, not a forger who can also rewrite the
digest (our connections carry an epoch token for that). It releases the GIL.

A bucket is folded either whole (``update_bucket``) or as ``begin_bucket`` followed by its payload in consecutive
pieces (``update_at``): the hash is a stream, so both give the same digest. The piecewise form lets the pipeline
hash each piece right after copying it, while the bytes are still in the core's cache: hashing a bucket afterwards
reads it from memory a second time, several times slower than from cache.
"""

from __future__ import annotations

import xxhash

import torch

from weightsync.core.wire.codec import TensorMeta
from weightsync.core.wire.tensors import memoryview_at, memoryview_of

__all__ = ["StripedDigest", "UpdateDigest", "combine_stripes"]


class UpdateDigest:
    fusable = True
    """Whether host payloads may be fed piecewise through ``begin_bucket``/``update_at`` (a digest that must stage
    device buckets first says no, and gets whole buckets)."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()

    def select(self, sender: int) -> None:
        """The next bucket is ``sender``'s (an update from several senders folds each into its sender's digest:
        ``weightsync.core.wire.sources.SourcesDigest``); one digest folds every bucket."""

    def of(self, sender: int) -> UpdateDigest:
        """The digest ``sender``'s buckets fold into, for a thread other than the one that ``select``s (a receive
        thread hashing whole buckets): this one, or that sender's own."""
        return self

    def begin_bucket(self, table: bytes, nbytes: int) -> None:
        self._hash.update(len(table).to_bytes(8, "little"))
        self._hash.update(table)
        self._hash.update(nbytes.to_bytes(8, "little"))

    def update_at(self, address: int, nbytes: int) -> None:
        """Fold the next ``nbytes`` of the current bucket's payload, read from host memory at ``address``."""
        if nbytes > 0:
            self._hash.update(memoryview_at(address, nbytes))

    def begin_blocks(self, meta: TensorMeta) -> bool:
        """Whether the bucket's next piece ``meta``, of a tensor packed block after block, may be fed block by
        block (``update_block``, the blocks' bytes interleaved, each block's in order; then ``end_blocks``) instead
        of in bucket order: only a digest of the parts' sums can (``PartsDigest``), this one reads every byte."""
        return False

    def update_block(self, block: int, address: int, nbytes: int) -> None:
        raise NotImplementedError("a digest fed in bucket order takes no blocks")

    def end_blocks(self, meta: TensorMeta, address: int) -> None:
        raise NotImplementedError("a digest fed in bucket order takes no blocks")

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self.begin_bucket(table, payload.numel())
        if payload.numel():
            self._hash.update(memoryview_of(payload))

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())

    def host(self) -> UpdateDigest:
        """The digest host bytes are folded into: this one, or, for a digest that stages device buckets to the host
        first, the host digest inside it (a bucket packed from host bytes is hashed there, never staged back)."""
        return self


def combine_stripes(digests: list[str]) -> str:
    """The digest of an update dealt into ``len(digests)`` stripes, from each stripe's digest in stripe order (one
    stripe: its own digest, so a one-stripe update's digest is the unstriped one)."""
    if len(digests) == 1:
        return digests[0]
    combined = xxhash.xxh3_128()
    combined.update(f"weightsync stripes {len(digests)}".encode())
    for digest in digests:  # as written: a stripe verified by parts alone has a digest of its sums (``parts-...``)
        combined.update(digest.encode() + b"\0")
    return str(combined.hexdigest())


class StripedDigest(UpdateDigest):
    """The digest of an update whose buckets are dealt into ``stripes`` stripes (bucket i in stripe i mod K), each
    sent by a sender of its own that folds only its stripe's buckets. A receiver, which gets every bucket in bucket
    order, folds each into its stripe's digest (buckets are begun in bucket order: the n-th begun is bucket n);
    ``hexdigest`` is :func:`combine_stripes` of the stripes' digests, what the senders' digests combine to."""

    def __init__(self, stripes: int) -> None:
        super().__init__()
        self._parts = [UpdateDigest() for _ in range(stripes)]
        self._begun = 0
        self._current = self._parts[0]

    def _next(self) -> UpdateDigest:
        self._current = self._parts[self._begun % len(self._parts)]
        self._begun += 1
        return self._current

    def begin_bucket(self, table: bytes, nbytes: int) -> None:
        self._next().begin_bucket(table, nbytes)

    def update_at(self, address: int, nbytes: int) -> None:
        self._current.update_at(address, nbytes)

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self._next().update_bucket(table, payload)

    def hexdigest(self) -> str:
        return combine_stripes([part.hexdigest() for part in self._parts])
