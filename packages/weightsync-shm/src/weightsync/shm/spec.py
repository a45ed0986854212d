"""Registry data for the ``shm`` backend (imports nothing heavy)."""

from __future__ import annotations

import os

from weightsync.api.registry import BackendSpec, module_importable


def _probe() -> str | None:
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return "/dev/shm is missing or not writable"
    return module_importable("torch", "msgspec")


SPEC = BackendSpec(name="shm", engine="weightsync.shm.engine:ShmCheckpointEngine",
                   distribution="weightsync-shm", devices=frozenset({"cpu"}), cross_node=False, probe=_probe,
                   description="same-host POSIX shared memory ring; the fast default on one machine")
