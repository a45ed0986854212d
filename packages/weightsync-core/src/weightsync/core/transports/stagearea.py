"""A host's staging area: one update's buckets, exactly as they arrived, in one ``/dev/shm`` segment of the host.

A staged update (``SyncConfig(staged=True)``) arrives in two phases. In the *stage* phase, while the replicas keep
serving, one worker per host (the host's stager) receives the update over any transport and appends every bucket —
its header bytes and its payload, delta-encoded or dense, as sent — to the area (:class:`StageArea`), hashing the
staged bytes into the update's digest. In the *swap* phase every worker of the host reads the area in place through
a :class:`StagedReceiver`, a ``ReceiverTransport`` that replays the records: the receive pipeline above it is the one
a network update goes through (destinations, fallbacks, delta apply, the digest checked again on what was read), so
the swap writes the live parameters exactly as an unstaged update does.

Memory: the mapping doubles while the first update is staged (``ftruncate`` of the same file and a new mapping:
nothing is copied) and its pages are allocated in ``GROWTH`` steps as they are needed (``posix_fallocate`` on tmpfs,
so a write maps a page that exists rather than allocating and zeroing one); sealed, it is trimmed to that update's size, and then kept, and reused, for
every later update: one model's size plus its headers per host.

Layout: a page of area header (magic, state, the update's version and epoch, records, bytes used, bucket capacity),
then records, each a 16-byte length pair (header, payload), the header bytes, and the payload at the next
``PAYLOAD_ALIGN`` boundary. Only the stager writes; readers map the area after it was sealed, and a reader checks
the seal and the version it was told to read before it trusts a byte.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref

import torch

from weightsync.api.config import MiB
from weightsync.api.errors import TransferError, WireError
from weightsync.api.types import StagedUpdate, TransferReport
from weightsync.core.native import copy_bytes
from weightsync.core.transports.sharedmem import SHM_DIR, new_segment_prefix, reserve
from weightsync.core.transports.seam import ReceivedBucket

__all__ = ["StageArea", "StagedReceiver", "GROWTH", "PAYLOAD_ALIGN"]

GROWTH = 16 << 20
"""The area's size is a multiple of this: a model's area is at most this much larger than the model and its headers."""
PAYLOAD_ALIGN = 4096
"""Payloads start on a page, as a transport's bucket does (tensors inside a bucket keep their alignment)."""
_MAGIC = b"WSSTAGE1"
_HEAD = struct.Struct("<8sQQQQQQ64s")  # magic, sealed, version, records, used, capacity, epoch length, epoch
_RECORD = struct.Struct("<QQ")  # header bytes, payload bytes
_FIRST = 4096
_KEPT_AREAS = 8
"""Mappings a reading process keeps between updates: a striped update's areas (one per stripe, at most one per
rail) stay mapped."""


def _aligned(offset: int, alignment: int) -> int:
    return -(-offset // alignment) * alignment


_OWN: weakref.WeakValueDictionary[str, StageArea] = weakref.WeakValueDictionary()
"""The areas this process writes, by name."""


class StageArea:
    """The stager's side: a growable segment an update's records are appended to, then sealed.

    One thread writes at a time (the stage loop); ``seal`` returns what the host's workers need to read it.
    """

    def __init__(self) -> None:
        self.name = f"{new_segment_prefix()}-0"
        self.path = os.path.join(SHM_DIR, self.name)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._map: mmap.mmap | None = None
        self._view: torch.Tensor | None = None
        self.size = 0
        self._used = _FIRST
        self._largest = _FIRST
        self._records = 0
        self._allocated = 0
        self._lock = threading.Lock()
        try:
            self._reserve(GROWTH)
        except BaseException:
            self.close()
            raise
        _OWN[self.name] = self

    @property
    def map(self) -> mmap.mmap:
        return self._mapped()[0]

    @property
    def tensor(self) -> torch.Tensor:
        return self._mapped()[1]

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` bytes: the mapping at least doubles when it must grow (few remaps), and the pages are
        allocated in ``GROWTH`` steps as far as they are needed (:func:`reserve`: on tmpfs they exist before
        they are written, and a full ``/dev/shm`` is a ``SharedMemoryFullError`` here, not a ``SIGBUS`` at a write)."""
        fd = self._fd
        if fd is None:
            raise TransferError("the staging area is closed")
        if needed > self.size:
            self._remap(_aligned(max(needed, 2 * self.size), GROWTH))
        if needed > self._allocated:
            upto = min(_aligned(needed, GROWTH), self.size)
            reserve(fd, self._allocated, upto - self._allocated,
                    what=f"this host's staging area (it holds {self._allocated / MiB:.1f} MiB of the update staged "
                         f"so far and needs {upto / MiB:.1f} MiB)", fix="update unstaged (SyncConfig(staged=False))")
            self._allocated = upto

    def _remap(self, size: int) -> None:
        fd = self._fd
        if fd is None:
            raise TransferError("the staging area is closed")
        os.ftruncate(fd, size)
        self._allocated = min(self._allocated, size)
        old, self._view = self._map, None
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self._view = torch.frombuffer(self._map, dtype=torch.uint8)
        self.size = size
        if old is not None:
            try:
                old.close()
            except BufferError:
                pass  # a view of it is still held; the old mapping goes with the view

    def begin(self, *, version: int, epoch: str, capacity: int) -> None:
        """Start staging ``version`` of membership epoch ``epoch`` (its buckets hold at most ``capacity`` bytes):
        the area is unsealed first, so no reader takes the previous update for this one."""
        with self._lock:
            self._used, self._records = _FIRST, 0
            self._write_head(sealed=False, version=version, epoch=epoch, capacity=capacity)

    def append(self, header: bytes, payload: torch.Tensor | None) -> torch.Tensor:
        """Append one record (``payload``: a host uint8 tensor, None for a marker); returns the staged payload's
        view in the area, valid until the area grows or the next ``begin``."""
        nbytes = 0 if payload is None else payload.numel()
        with self._lock:
            offset = self._used
            start = _aligned(offset + _RECORD.size + len(header), PAYLOAD_ALIGN)
            self._reserve(start + nbytes)
            mapping, view = self._mapped()
            mapping[offset: offset + _RECORD.size] = _RECORD.pack(len(header), nbytes)
            mapping[offset + _RECORD.size: offset + _RECORD.size + len(header)] = header
            if payload is not None and nbytes:
                copy_bytes(int(view.data_ptr()) + start, payload.data_ptr(), nbytes)
            self._used = start + nbytes
            self._records += 1
            return view[start: start + nbytes]

    def _mapped(self) -> tuple[mmap.mmap, torch.Tensor]:
        if self._map is None or self._view is None:
            raise TransferError("the staging area is closed")
        return self._map, self._view

    def seal(self, *, version: int, epoch: str, capacity: int, node_id: str = "",
             report: TransferReport | None = None) -> StagedUpdate:
        """Mark the records complete (the area trimmed to the largest update staged so far, in ``GROWTH`` steps);
        returns what a reader needs to replay them."""
        with self._lock:
            self._largest = max(self._largest, self._used)
            if self.size > _aligned(self._largest, GROWTH):
                self._remap(_aligned(self._largest, GROWTH))
            self._write_head(sealed=True, version=version, epoch=epoch, capacity=capacity)
            return StagedUpdate(area=self.name, size=self.size, version=version, epoch=epoch,
                                records=self._records, nbytes=self._used, node_id=node_id, report=report)

    def _write_head(self, *, sealed: bool, version: int, epoch: str, capacity: int) -> None:
        encoded = epoch.encode()
        if len(encoded) > 64:
            raise WireError(f"epoch token {epoch!r} is longer than a staging area holds")
        head = _HEAD.pack(_MAGIC, int(sealed), version, self._records, self._used, capacity, len(encoded), encoded)
        self._mapped()[0][: len(head)] = head

    def close(self) -> None:
        """Unmap and unlink (idempotent); a reader that still maps it keeps its mapping until it lets go."""
        with self._lock:
            mapping, fd = self._map, self._fd
            self._map = self._view = None
            self._fd = None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass
        if fd is not None:
            os.close(fd)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class _Mapping:
    """A reader's mapping of one area, kept between updates while the area keeps its size."""

    def __init__(self, name: str, size: int) -> None:
        if "/" in name or not name.startswith("weightsync-"):
            raise WireError(f"refusing staging area name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise WireError(f"staging area {name} is smaller than the announced {size} bytes")
            self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)


class StagedReceiver:
    """A ``ReceiverTransport`` that replays a sealed staging area, record by record, in place (no copy).

    Tokens are record numbers (the markers' 0); releases need nothing, since nobody writes the area while a swap
    reads it (the manager stages the next update only after every swap of this one ended).
    """

    _kept: dict[str, _Mapping] = {}
    """This process's mappings of the areas it read last (a worker reads its own host's area, or a striped update's
    areas, one per stripe): each kept for the next update while its area keeps its name and size."""
    _kept_lock = threading.Lock()

    def __init__(self, staged: StagedUpdate) -> None:
        self.staged = staged
        mapping = self._mapping(staged)
        self._tensor = mapping.tensor
        magic, sealed, version, records, used, capacity, length, epoch = _HEAD.unpack_from(mapping.map, 0)
        if magic != _MAGIC or not sealed or version != staged.version or records != staged.records or (
                used != staged.nbytes or epoch[:length].decode() != staged.epoch):
            raise TransferError(f"staging area {staged.area} does not hold the sealed version {staged.version} it "
                                "was announced with", peer="the host's stager")
        self.capacity = int(capacity)
        self._offset = _FIRST
        self._left = records
        self._record = 0

    @classmethod
    def _mapping(cls, staged: StagedUpdate) -> _Mapping | StageArea:
        own = _OWN.get(staged.area)
        if own is not None and own.size == staged.size:
            return own  # the stager reads its own area through the mapping it wrote it with
        with cls._kept_lock:
            kept = cls._kept.get(staged.area)
            if kept is None or kept.size != staged.size:
                if kept is None and len(cls._kept) >= _KEPT_AREAS:
                    cls._kept.pop(next(iter(cls._kept)))  # the oldest: an area of an earlier membership
                kept = cls._kept[staged.area] = _Mapping(staged.area, staged.size)
            return kept

    def receive(self, deadline: float) -> ReceivedBucket:
        if self._left <= 0:
            raise TransferError(f"staging area {self.staged.area} ended before the update's final header",
                                peer="the host's stager")
        header_bytes, nbytes = _RECORD.unpack(bytes(self._tensor[self._offset: self._offset + _RECORD.size]))
        header_at = self._offset + _RECORD.size
        start = _aligned(header_at + header_bytes, PAYLOAD_ALIGN)
        if start + nbytes > self.staged.nbytes:
            raise WireError(f"staging area {self.staged.area}: a record runs past the bytes staged")
        header = bytes(self._tensor[header_at: header_at + header_bytes])
        payload = self._tensor[start: start + nbytes]
        self._offset = start + nbytes
        self._left -= 1
        self._record += 1
        return ReceivedBucket(header=header, payload=payload, token=self._record if nbytes else 0)

    def release(self, token: int) -> None:
        """Nothing to hand back: the area is read in place and not written until the next stage."""

    def close(self) -> None:
        """The mapping stays for the next update of the same area."""
