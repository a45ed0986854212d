"""Registry data for the ``nixl`` backend (imports nothing heavy)."""

from __future__ import annotations

from weightsync.api.registry import BackendSpec, module_importable


def _probe() -> str | None:
    return module_importable("torch", "msgspec", "nixl")


SPEC = BackendSpec(name="nixl", engine="weightsync.nixl.engine:NixlCheckpointEngine",
                   distribution="weightsync-nixl", devices=frozenset({"cpu", "cuda"}), cross_node=True, probe=_probe,
                   description="NIXL (UCX): pipelined chain of one-sided reads, DRAM or VRAM")
