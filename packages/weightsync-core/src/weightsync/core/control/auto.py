"""``backend="auto"``: the manager picks the backend from where the workers are, at every (re)build of the topology.

- Every rollout worker on the sender's host (same ``node_id`` as actor rank 0): ``shm``, one copy in shared memory.
- Workers on other hosts: the fastest network transport installed here, a chain backend in the two-level layout
  (one reader per host over the network, the host's other workers reading its ring in place; see
  :mod:`weightsync.core.transports.chain.topology`), else gloo's broadcast. Which is fastest depends on the NICs: where
  every worker's host has an RDMA device, ``RDMA_ORDER`` (nixl, whose UCX then bypasses the kernel, first); elsewhere
  ``TCP_ORDER`` (the plain-socket ``tcp`` chain first: UCX would fall back to TCP too, for more CPU per byte).

Where a chain backend is picked and every host has several rails (NICs for weight traffic, ``rail`` in each
worker's ping), the update is dealt into stripes, one per rail (``stripes``: see
:mod:`weightsync.core.transports.chain.stripes`): over every rail that has an actor rank on the sender's host and a
worker on every receiving host, less any rail an update lost (:mod:`weightsync.core.control.rails`); one rail
anywhere keeps the plain two-level layout.

Both layouts map a ring in each host's ``/dev/shm`` (``shm``: ``slots`` × ``bucket_bytes``, 4 slots by default; the
two-level layout's host ring: 2 slots by default). Where a host's ``/dev/shm`` has less free than that (a container's
default is 64 MiB), ``auto`` picks the same network transport in its flat layout (a chain over sockets, nothing in
``/dev/shm``) and says why; a named ``shm`` backend fails at setup with ``SharedMemoryFullError`` instead.

Where the workers are comes from a ``ping`` of each (its ``node_id``, its ``rail``, and whether its host has an RDMA
device), so the choice needs no engine. It is made again whenever the topology is rebuilt (membership changed, or the last
update failed): replicas added on another host turn ``shm`` into the two-level chain. ``backend_options`` go to
whichever backend is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from weightsync.api.config import MiB
from weightsync.api.errors import BackendUnavailableError
from weightsync.api.registry import KNOWN_BACKENDS, available_backends
from weightsync.api.types import JsonValue
from weightsync.core.transports.chain.topology import stripe_rails
from weightsync.core.transports.place import has_rdma
from weightsync.core.transports.sharedmem import SHM_DIR, ShmSpace, shm_space

__all__ = [
    "AUTO", "DEFAULT_SLOTS", "RDMA_ORDER", "TCP_ORDER", "AutoChoice", "candidates", "choose", "describe_rule",
    "describe_shm", "network_order", "ring_bytes",
]

AUTO = "auto"

TCP_ORDER = ("tcp", "nixl", "mooncake", "gloo")
"""Fastest first over TCP, as ``weightsync bench --hosts`` measured them on the testbed (docs/performance.md: at
H = 4, tcp 0.76 of the link, nixl 0.59, gloo's rank-order broadcast 0.19)."""
RDMA_ORDER = ("nixl", "mooncake", "tcp", "gloo")
"""Fastest first where every host has an RDMA device: the one-sided libraries move bytes without the kernel (not
measured here: no machine of ours has an RDMA device)."""

_TWO_LEVEL = frozenset({"nixl", "mooncake", "tcp"})
DEFAULT_SLOTS = {"shm": 4, "two_level": 2}
"""Slots of the rings ``auto``'s layouts map in ``/dev/shm`` when ``SyncConfig.slots`` is None: the shm engine's and
the chain transport's ``default_slots`` (a test holds them equal)."""


def ring_bytes(layout: str, *, bucket_bytes: int, slots: int | None) -> int:
    """What ``layout`` (``"shm"`` or ``"two_level"``) maps in each host's ``/dev/shm``."""
    return (slots or DEFAULT_SLOTS[layout]) * bucket_bytes


def _short_of_shm(nodes: Sequence[str], shm_free: Mapping[str, int], need: int, layout: str,
                  names: Mapping[str, str]) -> str:
    """Why ``layout`` does not fit (the first of ``nodes`` whose ``/dev/shm`` has less than ``need`` free), or ''."""
    for node in nodes:
        free = shm_free.get(node)
        if free is not None and free < need:
            what = "shm's ring" if layout == "shm" else "the two-level layout's host ring"
            return (f"{SHM_DIR} on {names.get(node, node)} has {free / MiB:.1f} MiB free and {what} needs "
                    f"{need / MiB:.1f} MiB, so a flat chain over sockets, which maps nothing there (give {SHM_DIR} "
                    "more room, e.g. a container's --shm-size, for the faster layout)")
    return ""


def network_order(*, rdma: bool) -> tuple[str, ...]:
    return RDMA_ORDER if rdma else TCP_ORDER


@dataclass(frozen=True)
class AutoChoice:
    """The backend ``auto`` picked, the options it adds, and why."""

    backend: str
    options: dict[str, JsonValue] = field(default_factory=dict)
    reason: str = ""
    groups: tuple[int, int] = (1, 1)
    """The part groups the topology dealt (:mod:`weightsync.core.transports.chain.groups`), each a stream of its own,
    and each group's stripes (set by the setup, from the topology)."""

    @property
    def name(self) -> str:
        """What reports show: the backend, and its layout when not the default (``"nixl (two-level)"``,
        ``"tcp (two-level, 2 stripes)"``, ``"tcp (two-level, 2 part groups of 2 stripes)"``)."""
        if self.options.get("layout") != "two_level":
            return self.backend
        groups, each = self.groups
        if groups > 1:
            return f"{self.backend} (two-level, {groups} part groups{f' of {each} stripes' if each > 1 else ''})"
        stripes = self.options.get("stripes", 1)
        if isinstance(stripes, list):  # rails past a gap (a rail left out)
            return f"{self.backend} (two-level, {len(stripes)} stripes: rails {', '.join(map(str, stripes))})"
        return f"{self.backend} (two-level, {stripes} stripes)" if stripes != 1 else f"{self.backend} (two-level)"


def choose(*, sender_node: str, rollout_nodes: Sequence[str], rdma: bool = False,
           available: Callable[[], Sequence[str]] = available_backends, sender_rails: Sequence[int] = (0,),
           rollout_rails: Sequence[int] | None = None, striping: bool = True,
           lost_rails: Collection[int] = (), shm_free: Mapping[str, int] | None = None,
           bucket_bytes: int = 64 * MiB, slots: int | None = None,
           host_names: Mapping[str, str] | None = None) -> AutoChoice:
    """The choice for a sender on ``sender_node`` and rollout workers on ``rollout_nodes``; ``rdma``: every
    worker's host has an RDMA device; ``sender_rails``: the rails of the actor ranks on the sender's host,
    ``rollout_rails``: each rollout worker's (None: all on rail 0); ``striping``: stripes may be used (not with
    delta updates, which stripes do not carry yet); ``lost_rails``: rails an update lost (a stripe's, a part group's
    stream's) and no probe has reached since (:mod:`weightsync.core.control.rails`): they are left out of the stripes
    and of the part groups (the ``left_out`` option);
    ``shm_free``: each node's free bytes in ``/dev/shm`` (a node not in it: taken to have room), against what a
    layout maps there at ``bucket_bytes`` and ``slots`` (:func:`ring_bytes`)."""
    usable = set(available())
    nodes = list(dict.fromkeys((sender_node, *rollout_nodes)))
    hosts = len(nodes)
    layout = "shm" if hosts == 1 and "shm" in usable else "two_level"
    short = _short_of_shm(nodes, shm_free or {}, ring_bytes(layout, bucket_bytes=bucket_bytes, slots=slots), layout,
                          host_names or {})
    if layout == "shm" and not short:
        return AutoChoice("shm", reason="every worker shares the sender's host")
    for name in network_order(rdma=rdma):
        if name in usable:
            two_level = name in _TWO_LEVEL and not short
            options: dict[str, JsonValue] = {"layout": "two_level"} if two_level else {}
            where = f"workers on {hosts} hosts" if hosts > 1 else "shm is not available"
            if short:
                where = (where if hosts > 1 else "every worker shares the sender's host") + ", but " + short
            nics = "with RDMA devices" if rdma else "without RDMA devices on every host"
            reason = f"{where}: the fastest network transport installed {nics}"
            where_rails = list(zip(rollout_nodes, rollout_rails or [0] * len(rollout_nodes)))
            common = stripe_rails(sender_node=sender_node, sender_rails=sender_rails, rollout=where_rails)
            rails = stripe_rails(sender_node=sender_node, sender_rails=sender_rails, rollout=where_rails,
                                 leaving_out=lost_rails) if options and striping else [0]
            left_out = sorted(set(common) & set(lost_rails)) if options else []
            if left_out:  # no stripe, and no part group's stream (transports.chain.groups), goes over them
                options["left_out"] = list(left_out)
                reason += (f"; rail{'s' if len(left_out) > 1 else ''} {', '.join(map(str, left_out))} left out: "
                           "failed an update and no probe has reached it since")
            if len(rails) > 1:
                # A count keeps the option readable where the rails are 0..K-1; a list names rails past a gap.
                options["stripes"] = len(rails) if rails == list(range(len(rails))) else list(rails)
                reason += (f"; dealt into {len(rails)} stripes, one per rail: rails {', '.join(map(str, rails))} each "
                           "have an actor rank on the sender's host and a worker on every receiving host")
            return AutoChoice(name, options, reason=reason)
    wanted = ", ".join(f"{name} (pip install {KNOWN_BACKENDS[name]})" for name in network_order(rdma=rdma)
                       if name in KNOWN_BACKENDS)
    raise BackendUnavailableError(
        f"backend='auto' found workers on {hosts} hosts and no backend here that crosses hosts; install one of: "
        f"{wanted}", backend=AUTO, reason=f"no backend that crosses hosts; install one of: {wanted}")


def candidates(available: Callable[[], Sequence[str]] = available_backends) -> list[str]:
    """Every backend ``auto`` may pick here (on one host or across hosts, with RDMA devices or without)."""
    usable = set(available())
    return [name for name in dict.fromkeys(("shm", *TCP_ORDER, *RDMA_ORDER)) if name in usable]


def describe_rule(available: Callable[[], Sequence[str]] = available_backends, *, rdma: bool | None = None,
                  space: ShmSpace | None = None) -> str:
    """One line for ``weightsync doctor``: what ``auto`` would pick here at the default bucket size, on one host and
    across hosts (between hosts like this one: ``rdma`` defaults to whether this host has an RDMA device, ``space``
    to this host's ``/dev/shm``)."""
    rdma = has_rdma() if rdma is None else rdma
    free = (space or shm_space()).free

    def picked(*rollout: str) -> str:
        try:
            choice = choose(sender_node="this host", rollout_nodes=rollout, rdma=rdma, available=available,
                            shm_free={node: free for node in ("this host", *rollout)})
        except BackendUnavailableError:
            return ""
        flat = choice.backend in _TWO_LEVEL and "layout" not in choice.options
        return f"{choice.name} (flat chain: {SHM_DIR} too small)" if flat else choice.name

    one_host, across = picked("this host"), picked("another host")
    nics = "with" if rdma else "without"
    striped = "; a chain in one stripe per rail where every host has several" if "two-level" in across else ""
    return (f"auto picks {one_host or 'nothing (no backend available)'} when every worker shares the sender's "
            f"host, {across or 'nothing (no network backend available)'} across hosts {nics} RDMA devices{striped}")


def describe_shm(space: ShmSpace | None = None, *, bucket_bytes: int = 64 * MiB) -> str:
    """One line for ``weightsync doctor``: ``/dev/shm``'s room against what the layouts map there at the defaults."""
    space = space or shm_space()
    needs = [(what, ring_bytes(layout, bucket_bytes=bucket_bytes, slots=None))
             for what, layout in (("shm's ring", "shm"), ("a two-level host ring", "two_level"))]
    fits = "; ".join(f"{what} needs {need / MiB:.0f} MiB ({'fits' if need <= space.free else 'does NOT fit'})"
                     for what, need in needs)
    line = (f"{SHM_DIR}: {space.size / MiB:.1f} MiB, {space.free / MiB:.1f} MiB free; at {bucket_bytes / MiB:.0f} "
            f"MiB buckets {fits}")
    if any(need > space.free for _, need in needs):
        line += (f" — auto then uses a flat chain, a named shm backend fails with SharedMemoryFullError, staged "
                 f"updates need the model's size there: give {SHM_DIR} more room (a container's --shm-size=2g) or "
                 "pass smaller bucket_bytes/slots")
    return line
