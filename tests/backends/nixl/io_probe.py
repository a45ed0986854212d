"""Counts NIXL calls from outside the engine: wrappers around ``nixl_agent`` installed in a worker process.

Installed by the probed source/sink when a Ray actor builds it (before any engine exists in that process), so
every agent, registration and read the engine makes in that process goes through the wrappers.
"""

from __future__ import annotations

import functools
from typing import Any

from tests.backends.mooncake.chain_world import IoLog, ProbedSinkBase, ProbedSourceBase

LOG = IoLog()


@functools.cache  # once per process: every engine built there goes through the same wrappers
def install() -> None:
    from nixl import _api

    agent_class: Any = _api.nixl_agent
    original_init = agent_class.__init__
    original_register = agent_class.register_memory
    original_deregister = agent_class.deregister_memory
    original_descs = agent_class.get_xfer_descs
    original_initialize = agent_class.initialize_xfer
    descriptor_bytes: dict[int, int] = {}

    def init(self: Any, agent_name: str, *args: Any, **kwargs: Any) -> None:
        LOG.identity(agent_name)
        original_init(self, agent_name, *args, **kwargs)

    def register_memory(self: Any, reg_list: Any, *args: Any, **kwargs: Any) -> Any:
        LOG.registered(int(reg_list.numel() * reg_list.element_size()) if hasattr(reg_list, "numel") else -1)
        return original_register(self, reg_list, *args, **kwargs)

    def deregister_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        LOG.deregistered()
        return original_deregister(self, *args, **kwargs)

    def get_xfer_descs(self: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_descs(self, descs, *args, **kwargs)
        if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
            descriptor_bytes[id(result)] = sum(int(item[1]) for item in descs)
        return result

    def initialize_xfer(self: Any, operation: str, local: Any, remote: Any, remote_agent: Any,
                        *args: Any, **kwargs: Any) -> Any:
        handle = original_initialize(self, operation, local, remote, remote_agent, *args, **kwargs)
        name = remote_agent.decode() if isinstance(remote_agent, bytes) else str(remote_agent)
        LOG.read(name, descriptor_bytes.pop(id(remote), -1) if operation == "READ" else 0)
        descriptor_bytes.pop(id(local), None)
        return handle

    agent_class.__init__ = init
    agent_class.register_memory = register_memory
    agent_class.deregister_memory = deregister_memory
    agent_class.get_xfer_descs = get_xfer_descs
    agent_class.initialize_xfer = initialize_xfer


class ProbedSource(ProbedSourceBase):
    install = staticmethod(install)
    log = LOG


class ProbedSink(ProbedSinkBase):
    install = staticmethod(install)
    log = LOG
