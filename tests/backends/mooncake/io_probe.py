"""Counts Mooncake TransferEngine calls from outside the engine: wrappers installed in a worker process."""

from __future__ import annotations

import functools
from typing import Any

from tests.backends.mooncake.chain_world import IoLog, ProbedSinkBase, ProbedSourceBase

LOG = IoLog()


@functools.cache  # once per process: every engine built there goes through the same wrappers
def install() -> None:
    from mooncake import engine

    engine_class: Any = engine.TransferEngine
    original_initialize = engine_class.initialize
    original_port = engine_class.get_rpc_port
    original_register = engine_class.register_memory
    original_unregister = engine_class.unregister_memory
    original_read = engine_class.transfer_sync_read
    hosts: dict[int, str] = {}

    def initialize(self: Any, host: str, *args: Any) -> Any:
        hosts[id(self)] = host
        return original_initialize(self, host, *args)

    def get_rpc_port(self: Any) -> Any:
        port = original_port(self)
        LOG.identity(f"{hosts.get(id(self), '?')}:{port}")
        return port

    def register_memory(self: Any, address: int, capacity: int, *args: Any) -> Any:
        LOG.registered(capacity)
        return original_register(self, address, capacity, *args)

    def unregister_memory(self: Any, *args: Any) -> Any:
        LOG.deregistered()
        return original_unregister(self, *args)

    def transfer_sync_read(self: Any, target: str, buffer: int, peer_address: int, length: int, *args: Any) -> Any:
        status = original_read(self, target, buffer, peer_address, length, *args)
        LOG.read(target, length if status == 0 else -1)
        return status

    engine_class.initialize = initialize
    engine_class.get_rpc_port = get_rpc_port
    engine_class.register_memory = register_memory
    engine_class.unregister_memory = unregister_memory
    engine_class.transfer_sync_read = transfer_sync_read


class ProbedSource(ProbedSourceBase):
    install = staticmethod(install)
    log = LOG


class ProbedSink(ProbedSinkBase):
    install = staticmethod(install)
    log = LOG
