"""Where this worker runs: its host's identity, its rail (the NIC its weight traffic uses) and that rail's devices,
whether the host has RDMA devices, and what a worker answers a ``ping`` with — the facts ``auto``, the stripes and
the libraries that pick their own interfaces (UCX) read, in one place.
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from weightsync.api.errors import ConfigError
from weightsync.core.transports.sharedmem import room

__all__ = [
    "LOCAL_RANK_ENV", "RAIL_ADDRS_ENV", "RDMA_CLASS", "PingAnswer", "Place", "Rail", "default_node_id", "devices_of",
    "has_rdma", "here", "local_rail", "ping_answer", "rail_devices", "reaches",
]

RAIL_ADDRS_ENV = "WEIGHTSYNC_RAIL_ADDRS"
"""This host's address on each of its rails (its NICs for weight traffic), comma-separated, rail 0 first; unset: one
rail, the worker's ``host_ip``."""
LOCAL_RANK_ENV = "LOCAL_RANK"
"""This process's rank among the workers of its host (torchrun's name; the bench and the Ray adapter set it)."""
RDMA_CLASS = "/sys/class/infiniband"


class Rail(msgspec.Struct, kw_only=True, frozen=True):
    """A worker's rail: the NIC its weight traffic uses (``rail`` of the host's ``rails``, at ``rail_address``)."""

    rail: int = 0
    rail_address: str = ""
    rails: int = 1


class Place(Rail, kw_only=True, frozen=True):
    """Where a worker runs: what every worker's ``prepare`` metadata and ``ping`` answer say about it (decoded from
    either with :func:`weightsync.core.transports.plan.decode_metadata`; their other keys are left to their readers).
    """

    node_id: str = ""
    """Its host's identity: workers with the same ``node_id`` share memory."""
    host_ip: str = ""
    """The address peers on other hosts reach it at."""
    hostname: str = ""
    pid: int = 0

    @property
    def host(self) -> str:
        """The host, for people: "name (address)", or whichever of them it gave."""
        if self.hostname and self.host_ip:
            return f"{self.hostname} ({self.host_ip})"
        return self.host_name or "of unknown name"

    @property
    def host_name(self) -> str:
        """The host's name, else its address, else its identity."""
        return self.hostname or self.host_ip or self.node_id


class PingAnswer(Place, kw_only=True, frozen=True):
    """What a worker answers a ``ping`` with (:func:`ping_answer`)."""

    rdma: bool = False
    """Its host has an RDMA device."""
    shm_free: int = -1
    """Bytes it could map in its host's ``/dev/shm``: the free ones plus those its own rings and staging area hold
    (:func:`~weightsync.core.transports.sharedmem.room`; -1: not said)."""
    reachable: dict[str, bool] = {}
    """Each address it was asked to probe: whether it reached it."""


@functools.cache
def default_node_id() -> str:
    """Identity of this host: hostname plus kernel boot id (two containers on one host differ by hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def has_rdma(root: str = RDMA_CLASS) -> bool:
    """Whether this host has an RDMA device (InfiniBand, RoCE or iWARP: the kernel lists each under ``root``)."""
    try:
        return any(True for _ in os.scandir(root))
    except OSError:
        return False


def local_rail(host_ip: str, local_rank: int | None = None) -> Rail:
    """This worker's rail, as a GPU node maps a GPU to its NIC: local rank ``LOCAL_RANK`` takes rail ``LOCAL_RANK
    mod K`` of the K addresses in ``WEIGHTSYNC_RAIL_ADDRS``; without rail addresses, rail 0 at ``host_ip`` of one.
    ``local_rank``: another worker's, for a process that answers for several (a vLLM replica's actor)."""
    addresses = [address.strip() for address in os.environ.get(RAIL_ADDRS_ENV, "").split(",") if address.strip()]
    if not addresses:
        return Rail(rail=0, rail_address=host_ip, rails=1)
    text = os.environ.get(LOCAL_RANK_ENV, "0") if local_rank is None else str(local_rank)
    try:
        local_rank = int(text)
    except ValueError:
        local_rank = -1
    if local_rank < 0:
        raise ConfigError(f"{LOCAL_RANK_ENV}={text!r}: a worker's local rank must be a non-negative int")
    rail = local_rank % len(addresses)
    return Rail(rail=rail, rail_address=addresses[rail], rails=len(addresses))


def rail_devices(host_ip: str) -> list[str]:
    """The devices of this worker's rail, as UCX's ``UCX_NET_DEVICES`` names them (:func:`devices_of` its rail
    address), for a library that picks its own interfaces; none on a host without rail addresses (a library then
    uses what it finds)."""
    if not os.environ.get(RAIL_ADDRS_ENV, "").strip():
        return []
    return devices_of(local_rail(host_ip).rail_address)


def devices_of(address: str) -> list[str]:
    """The network devices that carry IPv4 ``address`` on this host: each RDMA port behind the interface it is
    assigned to (``mlx5_0:1``: a RoCE NIC), then the interface itself (``eth1``); none when no interface has it."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) != address:
            continue
        ports: list[str] = []
        rdma = f"/sys/class/net/{name}/device/infiniband"
        for device in sorted(os.listdir(rdma)) if os.path.isdir(rdma) else []:
            listed = os.path.join(rdma, device, "ports")
            ports += [f"{device}:{port}" for port in sorted(os.listdir(listed))] if os.path.isdir(listed) else []
        return [*ports, name]
    return []


def _ipv4_of(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (SIOCGIFADDR), None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


_SIOCGIFADDR = 0x8915


def here(*, node_id: str, host_ip: str, local_rank: int | None = None) -> Place:
    """This worker's :class:`Place` (``local_rank`` as for :func:`local_rail`)."""
    return Place(node_id=node_id, host_ip=host_ip, hostname=socket.gethostname(), pid=os.getpid(),
                 **msgspec.structs.asdict(local_rail(host_ip, local_rank)))


def ping_answer(*, node_id: str, host_ip: str, probe: Sequence[str] = (), local_rank: int | None = None
                ) -> dict[str, Any]:
    """What a worker answers ``execute_checkpoint_engine("ping")`` with: where it runs (its host, RDMA devices and
    rail, and the room in its ``/dev/shm``). The manager's ``auto`` picks a backend from it; after a timeout, hosts
    none of whose workers answer are reported unreachable. ``probe``: addresses to try to reach (``reachable``:
    :func:`reaches` of each) — a lost rail is probed so before stripes use it again."""
    answer = PingAnswer(rdma=has_rdma(), shm_free=room(), reachable={address: reaches(address) for address in probe},
                        **msgspec.structs.asdict(here(node_id=node_id, host_ip=host_ip, local_rank=local_rank)))
    encoded: dict[str, Any] = msgspec.to_builtins(answer)
    return encoded


_RETRY_WINDOW_S = 0.5
"""The least time :func:`reaches` gives a connection it tries again after a quick failure."""


def reaches(address: str, *, timeout: float = 1.0) -> bool:
    """Whether packets get to ``address`` and back: a TCP connection to its discard port, refused or accepted, within
    ``timeout`` (a cut link times out or has no route). A quick failure is tried again, each try with the time left
    but at least :data:`_RETRY_WINDOW_S`: over a link that has just come back, the first connection fails with "no
    route to host" where the kernel resolved the address's neighbour entry while the link was down, and that
    resolution ends (failed) after the link is back, up to a second later; the next connection gets through."""
    deadline = time.monotonic() + timeout
    window = timeout
    while True:
        try:
            socket.create_connection((address, 9), timeout=window).close()
        except ConnectionRefusedError:
            return True
        except TimeoutError:
            return False
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # a route that fails at once keeps failing: a bounded number of tries
            window = max(deadline - time.monotonic(), _RETRY_WINDOW_S)
        else:
            return True
