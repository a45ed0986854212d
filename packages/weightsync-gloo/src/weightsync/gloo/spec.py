"""Registry data for the ``gloo`` backend (imports nothing heavy)."""

from __future__ import annotations

from weightsync.api.registry import BackendSpec, module_importable

SPEC = BackendSpec(name="gloo", engine="weightsync.gloo.collective:GlooCheckpointEngine",
                   distribution="weightsync-gloo", devices=frozenset({"cpu"}), cross_node=True,
                   probe=lambda: module_importable("torch"),
                   description="torch.distributed gloo broadcast in a private process group; crosses nodes")
