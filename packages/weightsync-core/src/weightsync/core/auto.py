"""``backend="auto"``: the manager picks the backend from where the workers are, at every (re)build of the topology.

- Every rollout worker on the sender's host (same ``node_id`` as actor rank 0): ``shm``, one copy in shared memory.
- Workers on other hosts: the fastest network transport installed here, in ``NETWORK_ORDER``: a chain backend in
  the two-level layout (one reader per host over the network, the host's other workers reading its ring in place;
  see :mod:`weightsync.core.chaintopology`), else gloo's broadcast.

Where the workers are comes from a ``ping`` of each (its ``node_id``), so the choice needs no engine. It is made
again whenever the topology is rebuilt (membership changed, or the last update failed): replicas added on another
host turn ``shm`` into the two-level chain. ``backend_options`` go to whichever backend is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from weightsync.api.errors import BackendUnavailableError
from weightsync.api.registry import KNOWN_BACKENDS, available_backends
from weightsync.api.types import JsonValue

__all__ = ["AUTO", "NETWORK_ORDER", "AutoChoice", "choose", "describe_rule"]

AUTO = "auto"

NETWORK_ORDER = ("nixl", "mooncake", "gloo")
"""Fastest first, as ``weightsync bench --hosts`` measured them (docs/performance.md: nixl 0.76 of the link,
mooncake 0.57, gloo's rank-order broadcast 0.26 on 3 hosts)."""

_TWO_LEVEL = frozenset({"nixl", "mooncake"})


@dataclass(frozen=True)
class AutoChoice:
    """The backend ``auto`` picked, the options it adds, and why."""

    backend: str
    options: dict[str, JsonValue] = field(default_factory=dict)
    reason: str = ""

    @property
    def name(self) -> str:
        """What reports show: the backend, and its layout when not the default (``"nixl (two-level)"``)."""
        return f"{self.backend} (two-level)" if self.options.get("layout") == "two_level" else self.backend


def choose(*, sender_node: str, rollout_nodes: Sequence[str],
           available: Callable[[], Sequence[str]] = available_backends) -> AutoChoice:
    """The choice for a sender on ``sender_node`` and rollout workers on ``rollout_nodes``."""
    usable = set(available())
    hosts = len({sender_node, *rollout_nodes})
    if hosts == 1 and "shm" in usable:
        return AutoChoice("shm", reason="every worker shares the sender's host")
    for name in NETWORK_ORDER:
        if name in usable:
            options: dict[str, JsonValue] = {"layout": "two_level"} if name in _TWO_LEVEL else {}
            where = f"workers on {hosts} hosts" if hosts > 1 else "shm is not available"
            return AutoChoice(name, options, reason=f"{where}: the fastest network transport installed")
    wanted = ", ".join(f"{name} (pip install {KNOWN_BACKENDS[name]})" for name in NETWORK_ORDER
                       if name in KNOWN_BACKENDS)
    raise BackendUnavailableError(
        f"backend='auto' found workers on {hosts} hosts and no backend here that crosses hosts; install one of: "
        f"{wanted}", backend=AUTO, reason=f"no backend that crosses hosts; install one of: {wanted}")


def describe_rule(available: Callable[[], Sequence[str]] = available_backends) -> str:
    """One line for ``weightsync doctor``: what ``auto`` would pick here, on one host and across hosts."""
    usable = set(available())
    one_host = "shm" if "shm" in usable else next((name for name in NETWORK_ORDER if name in usable), None)
    across = next((AutoChoice(name, {"layout": "two_level"} if name in _TWO_LEVEL else {}).name
                   for name in NETWORK_ORDER if name in usable), None)
    return (f"auto picks {one_host or 'nothing (no backend available)'} when every worker shares the sender's "
            f"host, {across or 'nothing (no network backend available)'} across hosts")
