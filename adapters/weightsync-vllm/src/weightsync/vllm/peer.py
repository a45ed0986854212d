"""A vLLM replica as a peer of a replica that joins (``weightsync.api.peers.PeerWorker``).

Its worker keeps a copy of the version it holds when updates are deltas (vLLM's loader iterates views, so the
delta receiver keeps one): that copy is what it serves, through a second weightsync engine of the worker's
``EngineHost`` (``EngineHost.execute_as_peer`` / ``serve``). The serve runs in a thread of the vLLM worker's
process (:class:`PeerServing`), not in the RPC that starts it, so the engine core goes on scheduling and vLLM keeps
generating while the joining replica is caught up; the actor polls for its end (:func:`serve_from`). With staged
updates without delta the actor's own stager serves the update it staged, from the actor's process
(:func:`serving_stager`): vLLM is not asked at all. A replica of one worker only: the manager takes no other as a
peer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from weightsync.api.errors import LifecycleError
from weightsync.api.types import TransferReport
from weightsync.core.worker.host import EngineHost

__all__ = ["POLL_S", "PeerServing", "serve_from", "serving_stager"]

POLL_S = 0.05
"""How often the actor asks whether the serve ended (a short RPC through the engine core)."""


class PeerServing:
    """In a vLLM worker: the serve in progress, and its outcome as plain data (``{}`` while it runs)."""

    def __init__(self) -> None:
        self.outcome: dict[str, Any] = {}
        self._thread: threading.Thread | None = None

    def start(self, host: EngineHost, version: int) -> None:
        from weightsync.vllm.engine import error_to_data

        if self._thread is not None and self._thread.is_alive():
            raise LifecycleError("this vLLM worker is serving a joining replica already")
        self.outcome = {}

        def serve() -> None:
            try:
                self.outcome = {"report": asyncio.run(host.serve(version=version)).to_dict()}
            except BaseException as exc:  # noqa: BLE001 - it goes back as data, typed
                self.outcome = {"error": error_to_data(exc)}

        self._thread = threading.Thread(target=serve, name="weightsync-serve", daemon=True)
        self._thread.start()


async def serve_from(rpc: Callable[..., Awaitable[list[Any]]], version: int, *, name: str) -> TransferReport:
    """The actor's side of ``PeerWorker.serve_weights``: start the serve in the vLLM worker, then poll for its end
    (``rpc``: the actor's ``collective_rpc`` of one call on every worker)."""
    from weightsync.vllm.engine import error_from_data

    await rpc("weightsync_serve", version=version)
    while True:
        outcome: dict[str, Any] = (await rpc("weightsync_served"))[0]
        if "report" in outcome:
            return TransferReport.from_dict(outcome["report"])
        if "error" in outcome:
            raise error_from_data(outcome["error"], where=f"{name} (serving a joining replica)")
        await asyncio.sleep(POLL_S)


def serving_stager(stager: EngineHost | None, specs: Sequence[Mapping[str, Any]] | None) -> EngineHost | None:
    """The actor's stager when it is what serves a joining replica (its ``EngineHost`` in the actor's process, for
    the update it staged): with staged updates without delta (``specs``: the workers' engine specs); None when the
    vLLM worker serves (with delta, the copy its delta receiver keeps: the stager's area holds changes)."""
    if not specs or specs[0].get("config", {}).get("delta"):
        return None
    return stager
