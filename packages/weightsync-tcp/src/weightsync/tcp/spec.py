"""Registry data for the ``tcp`` backend (imports nothing heavy)."""

from __future__ import annotations

from weightsync.api.registry import BackendSpec, module_importable


def _probe() -> str | None:
    return module_importable("torch", "msgspec")


SPEC = BackendSpec(name="tcp", engine="weightsync.tcp.engine:TcpCheckpointEngine",
                   distribution="weightsync-tcp", devices=frozenset({"cpu", "cuda"}), cross_node=True, probe=_probe,
                   description="plain TCP: pipelined chain, each upstream serving reads of its host ring")
