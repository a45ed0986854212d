"""The end-to-end digest of one update.

Sender and every receiver fold each bucket's tensor table (names, dtypes, shapes, ranges) and payload bytes, in
bucket order, into a 128-bit XXH3 hash. Equal digests mean the receiver got exactly the bytes and layout that were
sent. XXH3 is not a cryptographic hash: it detects corruption and bugs, not a forger who can also rewrite the
digest (our connections carry an epoch token for that). It runs at memory speed and releases the GIL, so hashing
overlaps the other stages.
"""

from __future__ import annotations

import xxhash

import torch

from weightsync.core.tensors import memoryview_of

__all__ = ["UpdateDigest"]


class UpdateDigest:
    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()

    def update_bucket(self, table: bytes, payload: torch.Tensor) -> None:
        self._hash.update(len(table).to_bytes(8, "little"))
        self._hash.update(table)
        self._hash.update(payload.numel().to_bytes(8, "little"))
        if payload.numel():
            self._hash.update(memoryview_of(payload))

    def hexdigest(self) -> str:
        return str(self._hash.hexdigest())
