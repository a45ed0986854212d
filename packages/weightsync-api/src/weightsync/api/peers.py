"""A rollout worker that serves the version it holds to a replica that joins (catch-up from a peer): an optional
capability beside the Protocols of :mod:`weightsync.api.protocols`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

from weightsync.api.types import TransferReport

__all__ = ["PeerWorker"]


@runtime_checkable
class PeerWorker(Protocol):
    """Optional, on a ``RolloutWorker``: serve the version it holds to a replica that joins (catch-up from a peer).

    A replica added to a running manager catches up from a committed replica's worker rather than from the actor
    worker group. That worker acts as the one actor rank of a catch-up epoch of its own: ``execute_as_peer`` is
    ``execute_checkpoint_engine`` on a second engine the worker keeps for it (prepare → init_process_group → close,
    in the sender's role), and ``serve_weights`` sends what it holds through that engine — the copy its receiver
    keeps for delta updates (``SyncConfig.delta`` with a sink that iterates views), or, its host's stager, the full
    update it staged (``SyncConfig.staged``), never its sink's parameters. Serving does not touch the worker's own
    engine or model: its replica is not paused and keeps serving. A worker that holds no copy of ``version``
    refuses before anything is sent.
    """

    def execute_as_peer(self, method: str, /, **kwargs: Any) -> Awaitable[Any]:
        """``execute_checkpoint_engine`` on this worker's catch-up engine (the sender's role)."""
        ...

    def serve_weights(self, *, version: int) -> Awaitable[TransferReport]:
        """Send the copy of ``version`` this worker holds through its catch-up engine; the sender's report, whose
        ``model`` the manager checks against the version's."""
        ...
