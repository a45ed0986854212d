"""Backend ``gloo``: the collective transport of weightsync-core (a broadcast from actor rank 0 in a private
process group) on host buffers, with a gloo group. It crosses nodes; on one host ``shm`` is faster."""

from __future__ import annotations

from typing import ClassVar

from weightsync.core.backend import CollectiveTransport, engine_class

__all__ = ["GlooCheckpointEngine", "GlooTransport"]


class GlooTransport(CollectiveTransport):
    """Broadcast of host buckets in a private gloo group."""

    name: ClassVar[str] = "gloo"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})


GlooCheckpointEngine = engine_class(GlooTransport)
