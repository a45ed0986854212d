"""The ``mooncake`` engine: the one-sided chain of :mod:`weightsync.core.transports.chain.transport` over Mooncake's TransferEngine.

Each engine starts one ``TransferEngine`` with ``P2PHANDSHAKE`` metadata (no metadata server: a peer is addressed by
its ``host:rpc_port`` session id), protocol ``tcp`` — or ``rdma`` where the engine option ``protocol`` asks for it
and the host has RDMA devices — and registers its ring once.

Why reads run on a helper thread: ``transfer_sync_read`` takes no timeout (and the asynchronous batch API crashed
the 0.3.13 wheel when polled), so the receive thread waits for the read's future with the deadline and gives up
with a ``TransferError`` naming the upstream; a read that is still stuck then is abandoned with the epoch.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, ClassVar

from weightsync.api.errors import BackendUnavailableError, ConfigError, TransferError, WireError
from weightsync.core.backend import (
    ChainTransport, EngineSettings, RegisteredRing, RemoteRing, RingEndpoint, engine_class,
)

__all__ = ["MooncakeCheckpointEngine", "MooncakeTransport", "MooncakeRing"]


def _transfer_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise BackendUnavailableError(
            f"mooncake's TransferEngine does not load here ({exc}); install weightsync-mooncake[cpu] (CPU hosts, "
            f"needs Debian libibverbs1 librdmacm1 libnuma1) or weightsync-mooncake[cuda]",
            backend="mooncake", reason=str(exc),
        ) from exc
    return TransferEngine


class _MooncakePeer(RemoteRing):
    def __init__(self, ring: MooncakeRing, endpoint: RingEndpoint, peer: str) -> None:
        self._ring = ring
        self._session = endpoint.agent
        self._base = endpoint.base
        self._peer = peer
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ws-mooncake-read")

    def read(self, *, local_offset: int, remote_offset: int, nbytes: int, deadline: float) -> None:
        engine = self._ring.transfer_engine
        future = self._reader.submit(engine.transfer_sync_read, self._session, self._ring.base + local_offset,
                                     self._base + remote_offset, nbytes)
        try:
            status = future.result(timeout=max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            raise TransferError(f"timed out reading {nbytes} bytes from {self._peer} ({self._session})",
                                peer=self._peer) from None
        if status != 0:
            raise TransferError(f"mooncake read of {nbytes} bytes from {self._peer} ({self._session}) failed with "
                                f"status {status}", peer=self._peer)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)


class MooncakeRing(RegisteredRing):
    library: ClassVar[str] = "mooncake"

    def __init__(self, *, slots: int, slot_bytes: int, device: str, host: str, protocol: str) -> None:
        super().__init__(slots=slots, slot_bytes=slot_bytes, device=device)
        engine_class = _transfer_engine_class()
        self.transfer_engine = engine_class()
        status = self.transfer_engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if status != 0:
            raise BackendUnavailableError(f"mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) "
                                          f"returned {status}", backend="mooncake", reason=f"initialize: {status}")
        self.session = f"{host}:{self.transfer_engine.get_rpc_port()}"
        # "*" lets Mooncake place host memory itself (what its CPU build expects); GPU memory names its device.
        location = "*" if self.tensor.device.type == "cpu" else f"cuda:{self.tensor.device.index or 0}"
        status = self.transfer_engine.register_memory(self.base, slots * slot_bytes, location)
        if status != 0:
            raise BackendUnavailableError(f"mooncake could not register a {slots * slot_bytes}-byte ring "
                                          f"(status {status})", backend="mooncake", reason=f"register: {status}")
        self._registered = True
        self._lock = threading.Lock()

    def identity(self) -> tuple[str, bytes]:
        return self.session, b""

    def open(self, endpoint: RingEndpoint, *, peer: str) -> RemoteRing:
        host, _, port = endpoint.agent.rpartition(":")
        if not host or not port.isdigit():
            raise WireError(f"{peer} advertised a malformed mooncake session id {endpoint.agent!r}")
        return _MooncakePeer(self, endpoint, peer)

    def close(self) -> None:
        with self._lock:
            if not self._registered:
                return
            self._registered = False
        self.transfer_engine.unregister_memory(self.base)


class MooncakeTransport(ChainTransport):
    """Mooncake TransferEngine chain. Own options: ``fanout``, ``device`` (see the chain transport), ``protocol``
    (``"tcp"``, the default, or ``"rdma"``)."""

    name: ClassVar[str] = "mooncake"
    library: ClassVar[str] = "mooncake"
    option_names: ClassVar[frozenset[str]] = ChainTransport.option_names | {"protocol"}

    def __init__(self, settings: EngineSettings) -> None:
        super().__init__(settings)
        protocol = settings.options.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake: protocol must be 'tcp' or 'rdma', got {protocol!r}")
        self.protocol: str = protocol

    def make_ring(self) -> RegisteredRing:
        settings = self.settings
        return MooncakeRing(slots=settings.slots, slot_bytes=settings.bucket_bytes, device=self.ring_device,
                            host=settings.rail_address, protocol=self.protocol)


MooncakeCheckpointEngine = engine_class(MooncakeTransport)
