"""Shared-memory segments: ``/dev/shm`` files mapped by every process of one host that needs a bucket ring.

Used by the ``shm`` backend (its whole ring) and by the chain's two-level layout (a host leader's ring, which the
other workers of its host read in place).

Why our own mapping code rather than ``multiprocessing.shared_memory``: on Python < 3.13 every process that
attaches a ``SharedMemory`` registers it with a resource tracker that unlinks it when that process exits, so a
reader's exit would delete the creator's segment. We open ``/dev/shm`` files directly; only the creator unlinks.
Names are ``weightsync-<creator pid>-<12 hex>-<n>``: a segment whose creator was killed is found by its name and
unlinked by the next creator on the host (``sweep_orphan_segments``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets

import torch

from weightsync.api.errors import WireError

__all__ = ["SHM_DIR", "SharedSegment", "new_segment_prefix", "sweep_orphan_segments"]

SHM_DIR = "/dev/shm"


def new_segment_prefix() -> str:
    """A fresh name prefix for this process's segments: append ``-<n>`` per segment."""
    return f"weightsync-{os.getpid()}-{secrets.token_hex(6)}"


class SharedSegment:
    """One ``/dev/shm`` file mapped into this process, viewed as a flat uint8 tensor."""

    def __init__(self, name: str, size: int, *, create: bool) -> None:
        if "/" in name or not name.startswith("weightsync-"):
            raise WireError(f"refusing shared-memory segment name {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
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
