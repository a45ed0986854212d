"""The engine host every Ray actor (and verl worker) runs, in this process: which engine classes it builds, and when
it reuses one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from weightsync.api.config import SyncConfig
from weightsync.api.errors import ConfigError
from weightsync.api.registry import BackendSpec, register_backend
from weightsync.api.types import RankArgs, Topology, WorldMetadata
from weightsync.core.worker.host import EngineHost, build_engine, engine_spec


class DuckEngine:
    """A CheckpointEngine by structure alone: no weightsync base class."""

    built: list[DuckEngine] = []

    def __init__(self, *, bucket_bytes: int, **options: Any) -> None:
        self.bucket_bytes = bucket_bytes
        self.options = options
        self.closed = False
        DuckEngine.built.append(self)

    def prepare(self) -> dict[str, Any]:
        return {"engine": len(DuckEngine.built)}

    @classmethod
    def build_topology(cls, *, actor_wg_world_size: int, rollout_world_size: int, metadata: WorldMetadata) -> Topology:
        return Topology(actor=[{}] * actor_wg_world_size, rollout=[{}] * rollout_world_size)

    def init_process_group(self, *, rank_args: RankArgs) -> None: ...

    async def send_weights(self, weights: Any, *, version: int) -> Any: ...

    def receive_weights(self) -> Any: ...

    def finalize(self) -> None: ...

    def close(self) -> None:
        self.closed = True


class NoReceiveEngine(DuckEngine):
    receive_weights = None  # type: ignore[assignment]


class InstanceTopologyEngine(DuckEngine):
    def build_topology(self, **kwargs: Any) -> Topology:  # type: ignore[override]
        raise AssertionError("never called")


_SPECS: dict[str, BackendSpec] = {}


def _register(name: str, attribute: str) -> str:
    """Register ``attribute`` of this module as backend ``name`` (the same spec object each time: idempotent)."""
    spec = _SPECS.setdefault(name, BackendSpec(
        name=name, engine=f"{__name__}:{attribute}", distribution="tests", devices=frozenset({"cpu"}),
        cross_node=False, probe=lambda: None,
    ))
    register_backend(spec)
    return name


def _spec(backend: str, **config: Any) -> dict[str, Any]:
    return engine_spec(backend=backend, config=SyncConfig(**config), role="actor", rank=0)


def test_any_class_with_the_protocols_members_is_built() -> None:
    backend = _register("test-duck", "DuckEngine")
    engine = build_engine(_spec(backend, slots=3), node_id="node", host_ip="10.0.0.1")
    assert isinstance(engine, DuckEngine)
    assert engine.options["slots"] == 3 and engine.options["context"].host_ip == "10.0.0.1"


@pytest.mark.parametrize(("attribute", "missing"), [
    ("NoReceiveEngine", "receive_weights"),
    ("InstanceTopologyEngine", "a class-level build_topology"),
])
def test_a_class_lacking_a_member_is_refused_naming_it(attribute: str, missing: str) -> None:
    backend = _register(f"test-{attribute.lower()}", attribute)
    with pytest.raises(ConfigError, match=f"is not a CheckpointEngine: it lacks {missing}"):
        build_engine(_spec(backend), node_id="node", host_ip="127.0.0.1")


def test_the_host_reuses_its_engine_while_the_spec_is_unchanged() -> None:
    backend = _register("test-duck", "DuckEngine")
    host = EngineHost(node_id="node")
    engines: list[Any] = []
    for slots in (2, 2, 4):  # the same spec twice, then another configuration
        asyncio.run(host.execute("prepare", engine=_spec(backend, slots=slots)))
        engines.append(host.engine)
    assert engines[0] is engines[1] and engines[2] is not engines[0]
    assert engines[0].closed and not engines[2].closed
    asyncio.run(host.execute("close"))
    assert host.engine is None and engines[2].closed


def test_the_host_runs_only_lifecycle_steps() -> None:
    host = EngineHost(node_id="node")
    with pytest.raises(ConfigError, match="unknown checkpoint-engine method 'held'"):
        asyncio.run(host.execute("held"))
