"""Shared-memory segments: ``/dev/shm`` files mapped by every process of one host that needs a bucket ring.

Used by the ``shm`` backend (its whole ring) and by the chain's two-level layout (a host leader's ring, which the
other workers of its host read in place).

Why our own mapping code rather than ``multiprocessing.shared_memory``: on Python < 3.13 every process that
attaches a ``SharedMemory`` registers it with a resource tracker that unlinks it when that process exits, so a
reader's exit would delete the creator's segment. We open ``/dev/shm`` files directly; only the creator unlinks.
Names are ``weightsync-<creator pid>-<12 hex>-<n>``: a segment whose creator was killed is found by its name and
unlinked by the next creator on the host (``sweep_orphan_segments``).

Every segment's pages are reserved when it is created (:func:`reserve`): on a tmpfs too small for it (Docker's
default ``/dev/shm`` is 64 MiB) the creator gets a :class:`SharedMemoryFullError` naming ``/dev/shm`` and the fix,
and stays alive; with only ``ftruncate`` the file would be sparse and the first write past the free pages a
``SIGBUS`` that kills the process. A free-space check alone would race with other engines and Ray's object store on
the same tmpfs.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from typing import NamedTuple

import torch

from weightsync.api.config import MiB
from weightsync.api.errors import SharedMemoryFullError, WireError

__all__ = [
    "SHM_DIR", "SharedSegment", "ShmSpace", "new_segment_prefix", "reserve", "room", "shm_space",
    "sweep_orphan_segments", "too_small",
]

SHM_DIR = "/dev/shm"


class ShmSpace(NamedTuple):
    """``/dev/shm``'s size and free bytes (both 0 where it is missing)."""

    size: int
    free: int


def shm_space(path: str = SHM_DIR) -> ShmSpace:
    try:
        stat = os.statvfs(path)
    except OSError:
        return ShmSpace(0, 0)
    return ShmSpace(stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize)


_HELD: dict[str, int] = {}
"""The ring segments this process created and still holds in ``/dev/shm``: name → bytes."""


def room(path: str = SHM_DIR) -> int:
    """The bytes a ring of this process could map in ``/dev/shm``: its free bytes plus those of the rings this
    process holds there (an engine reuses its ring when the next setup picks the same layout; a staging area is
    not counted: it stays beside the ring)."""
    return shm_space(path).free + sum(_HELD.values())


SMALLER = "ask for less (smaller bucket_bytes or slots)"


def reserve(fd: int, offset: int, length: int, *, what: str, fix: str = SMALLER) -> None:
    """Allocate the pages of ``[offset, offset + length)`` of the ``/dev/shm`` file ``fd`` now (the file grows to
    cover them): a :class:`SharedMemoryFullError` naming ``/dev/shm``, what it has and the fix when they do not fit.
    ``what``: the segment and its size, and ``fix``: what else than a larger ``/dev/shm`` helps, for the message. A
    file system without ``posix_fallocate`` gets the size only."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            if os.fstat(fd).st_size < offset + length:
                os.ftruncate(fd, offset + length)
            return
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):
            raise
        raise too_small(what, length, fix=fix) from None


def too_small(what: str, needed: int, *, fix: str = SMALLER) -> SharedMemoryFullError:
    """The error for ``what`` (``needed`` bytes) not fitting in ``/dev/shm`` as it is now."""
    space = shm_space()
    return SharedMemoryFullError(
        f"{SHM_DIR} has {space.free / MiB:.1f} MiB free of {space.size / MiB:.1f} MiB, too little for {what}: give "
        f"{SHM_DIR} more room (a container's --shm-size, e.g. docker run --shm-size=2g) or {fix}",
        path=SHM_DIR, free=space.free, size=space.size, needed=needed)


def new_segment_prefix() -> str:
    """A fresh name prefix for this process's segments: append ``-<n>`` per segment."""
    return f"weightsync-{os.getpid()}-{secrets.token_hex(6)}"


class SharedSegment:
    """One ``/dev/shm`` file mapped into this process, viewed as a flat uint8 tensor."""

    def __init__(self, name: str, size: int, *, create: bool, what: str = "") -> None:
        """``what``: the segment and its size, for the error when it does not fit (default: its size)."""
        if "/" in name or not name.startswith("weightsync-"):
            raise WireError(f"refusing shared-memory segment name {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                try:
                    reserve(fd, 0, size, what=what or f"a segment of {size / MiB:.1f} MiB")
                except SharedMemoryFullError:
                    os.unlink(self.path)
                    raise
                _HELD[name] = size
            elif os.fstat(fd).st_size < size:
                raise WireError(f"shared segment {name} is smaller than the announced {size} bytes")
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._map: mmap.mmap | None = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        if create:
            self.tensor.zero_()  # pre-fault every page once, here, not during the first update

    def close(self) -> None:
        """Idempotent: an engine closing under a transport that closes its segments too is fine."""
        mapping, self._map = self._map, None
        if mapping is None:
            return
        del self.tensor
        try:
            mapping.close()
        except BufferError:
            pass  # a consumer still holds a view; the mapping goes when it does
        if self.owner:
            _HELD.pop(self.name, None)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


_SEGMENT_NAME = re.compile(r"weightsync-(\d+)-[0-9a-f]{12}-\d+")


def sweep_orphan_segments() -> None:
    """Unlink ring segments whose creating process is gone (it was killed before ``close()`` could unlink them).

    Segment names carry the creator's pid. Receivers that still map such a segment keep their mapping (unlinking
    removes the name, not the memory). Limitation: two pid namespaces sharing one /dev/shm would see each other's
    processes as gone; run one sender per pid namespace and /dev/shm, as containers normally do.
    """
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        match = _SEGMENT_NAME.fullmatch(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        except PermissionError:
            pass  # alive, someone else's
