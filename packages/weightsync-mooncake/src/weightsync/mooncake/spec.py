"""Registry data for the ``mooncake`` backend (imports nothing heavy)."""

from __future__ import annotations

import ctypes.util

from weightsync.api.registry import BackendSpec, module_importable


def _probe() -> str | None:
    missing = module_importable("torch", "msgspec", "mooncake")
    if missing is not None:
        return f"{missing}: pip install weightsync-mooncake[cpu] (or weightsync-mooncake[cuda] on GPU machines)"
    # The CPU wheel links libibverbs even for TCP; without it the engine fails to import.
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs.so.1 is missing (Debian: apt-get install libibverbs1 librdmacm1 libnuma1)"
    return None


SPEC = BackendSpec(name="mooncake", engine="weightsync.mooncake.engine:MooncakeCheckpointEngine",
                   distribution="weightsync-mooncake", devices=frozenset({"cpu", "cuda"}), cross_node=True,
                   probe=_probe, description="Mooncake TransferEngine: pipelined chain of one-sided reads (TCP here, "
                                             "RDMA where present)")
