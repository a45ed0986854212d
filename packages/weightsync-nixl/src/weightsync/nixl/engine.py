"""The ``nixl`` engine: the one-sided chain of :mod:`weightsync.core.transports.chain.transport` over NIXL (UCX backend).

Each engine creates one NIXL agent (a unique name per process and engine) and registers its ring with it once.
A downstream receives the upstream's agent metadata in a typed
:class:`~weightsync.core.transports.chain.rings.RingEndpoint` (bytes that NIXL parses itself, never unpickled), adds the
agent, and builds read descriptors locally from the advertised address and slot size. Transfers are polled with sleeping
back-off until done or the deadline, when the request is released (NIXL cancels it) and a ``TransferError`` names the upstream — never ``exit()``.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from weightsync.api.errors import BackendUnavailableError, TransferError, WireError
from weightsync.core.backend import (
    ChainTransport,
    PendingRead,
    RegisteredRing,
    RemoteRing,
    RingEndpoint,
    engine_class,
    poll_until,
)

__all__ = ["NixlCheckpointEngine", "NixlTransport", "NixlRing"]


def _nixl_api() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise BackendUnavailableError(f"the nixl library does not load here: {exc}; pip install weightsync-nixl",
                                      backend="nixl", reason=str(exc)) from exc
    return _api


def _memory_kind(device: str) -> tuple[str, int]:
    """NIXL's segment type and device id for a torch device string (``cpu``, ``cuda:1``)."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return "VRAM", int(index or 0)
    return "DRAM", 0


class _NixlRead(PendingRead):
    """One NIXL read request: polled with sleeping back-off; its handle released once done or given up (NIXL then
    cancels it)."""

    def __init__(self, agent: Any, handle: Any, nbytes: int, peer: str) -> None:
        self._agent, self._handle, self._nbytes, self._peer = agent, handle, nbytes, peer
        self.state = "PROC"

    def wait(self, deadline: float) -> None:
        agent, nbytes = self._agent, self._nbytes
        try:
            if self.state == "PROC":
                def finished() -> bool:
                    self.state = agent.check_xfer_state(self._handle)
                    return bool(self.state != "PROC")

                # Each poll also progresses this side's UCX worker, which drains the incoming bytes: at most 1 ms
                # apart (the default 5 ms let a 2 Gb/s link idle; 0.2 ms costs more CPU than it gains on 2 cores).
                poll_until(finished, deadline=deadline, peer=self._peer, what=f"reading {nbytes} bytes from",
                           most=1e-3)
            if self.state != "DONE":
                raise TransferError(f"nixl read of {nbytes} bytes from {self._peer} failed (state {self.state})",
                                    peer=self._peer)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"nixl read of {nbytes} bytes from {self._peer} failed: {exc!r}",
                                peer=self._peer) from None
        finally:
            self.cancel()

    def cancel(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # a request that cannot be cancelled is reclaimed with the agent
            pass


class _NixlPeer(RemoteRing):
    def __init__(self, ring: NixlRing, agent_name: str, endpoint: RingEndpoint, peer: str) -> None:
        self._ring = ring
        self._agent_name = agent_name
        self._endpoint = endpoint
        self._remote_kind = _memory_kind(endpoint.memory)
        self._peer = peer
        self._closed = False

    def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
        self.start_read(local_offset=local_offset, remote_offset=remote_offset, nbytes=nbytes,
                        deadline=deadline).wait(deadline)

    def start_read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> PendingRead:
        agent = self._ring.agent
        self._ring._in_use()
        local_kind, local_device = self._ring.kind
        remote_kind, remote_device = self._remote_kind
        try:
            local = agent.get_xfer_descs([(self._ring.base + local_offset, nbytes, local_device)], local_kind)
            remote = agent.get_xfer_descs([(self._endpoint.base + remote_offset, nbytes, remote_device)], remote_kind)
            handle = agent.initialize_xfer("READ", local, remote, self._agent_name)
        except Exception as exc:  # nixl raises its own binding errors (nixlNotFoundError, ...)
            raise TransferError(f"nixl could not set up a {nbytes}-byte read from {self._peer}: {exc!r}",
                                peer=self._peer) from None
        pending = _NixlRead(agent, handle, nbytes, self._peer)
        try:
            pending.state = agent.transfer(handle)
        except Exception as exc:
            pending.cancel()
            raise TransferError(f"nixl read of {nbytes} bytes from {self._peer} failed: {exc!r}",
                                peer=self._peer) from None
        return pending

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._ring.agent.remove_remote_agent(self._agent_name)
        except Exception:  # already gone: nothing to release
            pass


PROGRESS_INTERVAL = 0.0005
"""Seconds between two rounds of the progress thread while the ring is in use (and ``ACTIVE_WINDOW`` after)."""
IDLE_PROGRESS_INTERVAL = 0.01
ACTIVE_WINDOW = 2.0


UCX_NET_DEVICES = "UCX_NET_DEVICES"
_AGENT_LOCK = threading.Lock()


class NixlRing(RegisteredRing):
    library: ClassVar[str] = "nixl"

    def __init__(self, *, slots: int, slot_bytes: int, device: str, agent_name: str,
                 net_devices: Sequence[str] = ()) -> None:
        """``net_devices``: the only network devices UCX may use (a rail's: ``UCX_NET_DEVICES`` while the agent is
        made), unless the user set ``UCX_NET_DEVICES``; none: what UCX finds."""
        super().__init__(slots=slots, slot_bytes=slot_bytes, device=device)
        api = _nixl_api()
        self.agent_name = agent_name
        # nixl's own progress thread runs with a zero delay: a core spinning for as long as the agent lives. Ours
        # sleeps between rounds (see ``_progress``); the agent is then called from two threads, hence the strict
        # thread-sync mode.
        config = api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        with _AGENT_LOCK:  # UCX reads its devices from the environment as the agent's context is made
            chosen = os.environ.get(UCX_NET_DEVICES)
            if net_devices and chosen is None:
                os.environ[UCX_NET_DEVICES] = ",".join(net_devices)
            try:
                self.agent = api.nixl_agent(agent_name, config)
            finally:
                if chosen is None:
                    os.environ.pop(UCX_NET_DEVICES, None)
        self.kind = _memory_kind(self.memory)
        # One registration for the whole ring, reused by every update and epoch.
        self._registration: Any = self.agent.register_memory(self.tensor)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._active_until = time.monotonic() + ACTIVE_WINDOW
        self._progress_thread = threading.Thread(target=self._progress, name=f"ws-nixl-progress-{agent_name}",
                                                 daemon=True)
        self._progress_thread.start()

    def _progress(self) -> None:
        """Drive the agent's UCX worker for peers that read from this ring or connect to it (their transfers
        need this side to answer): every ``PROGRESS_INTERVAL`` seconds while the ring is in use, every
        ``IDLE_PROGRESS_INTERVAL`` otherwise (an idle engine then costs about 0.5% of a core)."""
        interval = PROGRESS_INTERVAL
        while not self._stop.wait(interval):
            try:
                self.agent.get_new_notifs()
            except Exception:  # an agent being torn down: the loop ends with close()
                pass
            interval = PROGRESS_INTERVAL if time.monotonic() < self._active_until else IDLE_PROGRESS_INTERVAL

    def _in_use(self) -> None:
        self._active_until = time.monotonic() + ACTIVE_WINDOW

    def slot(self, index: int) -> torch.Tensor:
        self._in_use()  # packing into it, or consuming from it: an update is under way
        return super().slot(index)

    def endpoint(self, *, epoch: str) -> RingEndpoint:
        self._in_use()  # a new epoch: peers are about to connect
        return super().endpoint(epoch=epoch)

    def identity(self) -> tuple[str, bytes]:
        return self.agent_name, bytes(self.agent.get_agent_metadata())

    def open(self, endpoint: RingEndpoint, *, peer: str) -> RemoteRing:
        self._in_use()
        try:
            added = self.agent.add_remote_agent(endpoint.blob)
        except Exception as exc:
            raise WireError(f"nixl rejected the agent metadata of {peer}: {exc!r}") from None
        name = added.decode() if isinstance(added, bytes) else str(added)
        if name != endpoint.agent:
            raise WireError(f"{peer} advertised agent {endpoint.agent!r} but its metadata describes {name!r}")
        return _NixlPeer(self, name, endpoint, peer)

    def close(self) -> None:
        self._stop.set()
        self._progress_thread.join(timeout=5)
        with self._lock:
            registration, self._registration = self._registration, None
        if registration is not None:
            self.agent.deregister_memory(registration)


class NixlTransport(ChainTransport):
    """NIXL chain. Own options: ``fanout``, ``device`` (see the chain transport). With stripes on a host of rails,
    each ring's UCX context uses only its worker's rail (``UCX_NET_DEVICES``, unless the user set it)."""

    name: ClassVar[str] = "nixl"
    library: ClassVar[str] = "nixl"

    def make_ring(self) -> RegisteredRing:
        settings = self.settings
        agent_name = (f"weightsync-{settings.context.role}{settings.context.rank}-{os.getpid()}-"
                      f"{secrets.token_hex(4)}")
        # Stripes: each stripe's bytes must cross its own rail, and UCX left alone reads over the host's first
        # interface whatever the rail of the address it was given (the testbed's counters showed it).
        return NixlRing(slots=settings.slots, slot_bytes=settings.bucket_bytes, device=self.ring_device,
                        agent_name=agent_name, net_devices=settings.rail_devices if self.stripes != 1 else ())


NixlCheckpointEngine = engine_class(NixlTransport)
