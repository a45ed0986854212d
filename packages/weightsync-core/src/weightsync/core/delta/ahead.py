"""A delta receiver's sums read ahead of an update, so that verifying it reads only the words it changes.

After a verified delta update a receiver knows the model digest of what it holds, bucket by bucket, from a keyed
sum of every byte it holds (:mod:`weightsync.core.delta.encoding`): the pass that finds a destination changed
behind the engine's back. That pass is the most of a delta update's apply (a whole-model read, where the changes
are a few % of it), and in a staged update it runs while the replica is paused. The keyed sum's terms are
independent, so it can be split: :meth:`BaseSums.prepare` reads every byte where the last delta update wrote each
bucket, ahead of the next update (``EngineHost.prepare_swap``: while the replica serves, during the stage), and the
update then adds what its changes changed (the terms of the words they touch, before and after each write:
``apply(..., change=True)``), where its places are exactly those read ahead (same addresses, sizes, units and keys).
Any other bucket is summed whole in the apply, as before.

What it keeps honest: a sum read ahead is used only by the next update, and is dropped if an update began while it
was read (``begin`` and ``complete`` move a generation a read checks before it is kept); a place read ahead must
still be the tensor recorded there (alive, same address, same storage size), so nothing freed is ever read. What it
changes: a destination written behind the engine's back between the read ahead and the update is found by the next
update's read instead of this one's (as a destination written after an update is).
"""

from __future__ import annotations

import array
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.core.delta.encoding import applied_sum

__all__ = ["BaseSums"]


@dataclass(frozen=True)
class _Places:
    """Where one bucket's pieces were written: ``apply``'s rows, and the tensors they point into (each weakly, with
    its address and storage size then)."""

    rows: bytes
    holders: tuple[tuple[weakref.ref[torch.Tensor], int, int], ...]

    def alive(self) -> list[torch.Tensor] | None:
        """The holders, each still where it was; None if one is gone, moved or resized."""
        tensors = []
        for ref, address, size in self.holders:
            tensor = ref()
            if tensor is None or tensor.data_ptr() != address or tensor.untyped_storage().nbytes() != size:
                return None
            tensors.append(tensor)
        return tensors


class BaseSums:
    """One delta receiver's places per bucket (recorded by each delta update) and their sums read ahead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._places: dict[int, _Places] = {}
        self._ready: dict[int, tuple[bytes, int]] = {}
        """Read ahead since the last update ended: per bucket, (rows, keyed sum)."""
        self._base: dict[int, tuple[bytes, int]] = {}
        """This update's: what was read ahead of it."""
        self._generation = 0
        self._updating = False

    def begin(self) -> None:
        """An update begins, before it writes: what was read ahead is its base; a read still under way is dropped."""
        with self._lock:
            self._generation += 1
            self._updating = True
            self._base, self._ready = self._ready, {}

    def complete(self) -> None:
        """The update ended (verified): a read ahead may begin."""
        with self._lock:
            self._generation += 1
            self._updating = False
            self._base = {}

    def record(self, index: int, rows: array.array[int], holders: Sequence[torch.Tensor]) -> None:
        """Bucket ``index`` of this update was written at ``rows``, inside ``holders`` (for the next read ahead)."""
        places = _Places(rows.tobytes(), tuple((weakref.ref(tensor), tensor.data_ptr(),
                                                tensor.untyped_storage().nbytes()) for tensor in holders))
        with self._lock:
            self._places[index] = places

    def forget(self, index: int) -> None:
        """Bucket ``index`` was written where a later read cannot reach (host copies of device pieces, ...)."""
        with self._lock:
            self._places.pop(index, None)

    def base(self, index: int, rows: array.array[int]) -> int | None:
        """The keyed sum read ahead of this update at exactly ``rows`` for bucket ``index``, if any."""
        found = self._base.get(index)
        return found[1] if found is not None and found[0] == rows.tobytes() else None

    def prepare(self) -> int:
        """Read ahead (only reads; while the consumer serves): the keyed sum of every recorded bucket whose places
        are all still there. Kept for the next update unless one began meanwhile; how many buckets were read."""
        with self._lock:
            if self._updating:
                return 0
            generation, recorded = self._generation, dict(self._places)
        ready: dict[int, tuple[bytes, int]] = {}
        for index, places in recorded.items():
            alive = places.alive()  # held until summed: nothing read here can be freed meanwhile
            if alive is None:
                continue
            rows = array.array("Q")
            rows.frombytes(places.rows)
            ready[index] = (places.rows, applied_sum(rows))
            del alive
        with self._lock:
            if generation != self._generation:
                return 0
            self._ready = ready
        return len(ready)
