"""The kimi backend's pure part and its surface: our calls against checkpoint-engine's real signatures, the probe,
shares, the digest, the topology, options, and how the engine is built on core's public module."""

from __future__ import annotations

import ast
import datetime
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync.kimi
from weightsync.api.errors import BackendUnavailableError, ConfigError, RenamedKeywordError, TopologyError
from weightsync.api.protocols import CheckpointEngine
from weightsync.api.registry import get_backend_spec, load_engine_class
from weightsync.api.testing import case_tensors
from weightsync.api.types import WorkerContext, WorldMetadata
from weightsync.kimi.engine import KimiCheckpointEngine
from weightsync.kimi.groups import PrivateGroups
from weightsync.kimi.mapping import Exchange, SetDigest, ShareAssigner, ps_rank


# -- our calls against checkpoint-engine 0.4.2's real signatures -------------------------------------------------------


def test_our_calls_bind_to_checkpoint_engines_public_signatures() -> None:
    ps = pytest.importorskip("checkpoint_engine.ps")
    ce_dist = pytest.importorskip("checkpoint_engine.distributed")
    worker = pytest.importorskip("checkpoint_engine.worker")
    server = ps.ParameterServer
    timeout = datetime.timedelta(seconds=1)
    inspect.signature(server.__init__).bind(None, rank=0, world_size=2, auto_pg=False, mem_fraction=None,
                                            master_addr="127.0.0.1", master_port=1234)
    inspect.signature(server.init_process_group).bind(None, timeout=timeout)
    inspect.signature(server.register_checkpoint).bind(None, "name", named_tensors={}, use_shared_memory_pool=True)
    inspect.signature(server.gather_metas).bind(None, "name")
    inspect.signature(server.update).bind(None, "name", lambda paths: None, timeout=timeout, ranks=None)
    inspect.signature(server.unregister_checkpoint).bind(None, "name")
    inspect.signature(server.unregister_checkpoint).bind(None, "name", force=True)
    # Our private groups stand in for its Distributed implementation: every abstract method, each taking the
    # positional call that checkpoint_engine.distributed.base's module functions make.
    assert ce_dist.Distributed.__abstractmethods__ <= set(vars(PrivateGroups))
    assert isinstance(ce_dist.base._BACKEND_INSTANCE, ce_dist.Distributed)
    calls = {"init_process_group": (0, 2, object()), "destroy_process_group": (None,), "is_initialized": (),
             "all_gather_object": ([None], object(), None), "all_reduce": (torch.zeros(1), None, None),
             "broadcast": (torch.zeros(1), 0, None), "barrier": (None,), "new_group": ([0],)}
    for name, args in calls.items():
        inspect.signature(getattr(ce_dist.base, name)).bind(*args)
        inspect.signature(getattr(PrivateGroups, name)).bind(None, *args)
    inspect.signature(PrivateGroups.init_process_group).bind(None, 0, 2, object(), backend="nccl", timeout=timeout)
    inspect.signature(worker.update_weights_from_ipc).bind(object(), "ipc://x", 0, run=lambda weights: None)
    # The parameters we rely on being keyword-only stay so (a positional reorder upstream would break us silently).
    assert inspect.signature(server.update).parameters["ranks"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(server.__init__).parameters["auto_pg"].kind is inspect.Parameter.KEYWORD_ONLY


def test_probe_explains_that_cuda_is_needed_here() -> None:
    spec = get_backend_spec("kimi")
    assert spec.devices == frozenset({"cuda"})
    reason = spec.probe()
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert reason is not None and "CUDA" in reason
    with pytest.raises(BackendUnavailableError, match="kimi"):
        load_engine_class("kimi")


# -- the pure mapping -------------------------------------------------------------------------------------------


def test_shares_are_disjoint_balanced_and_the_same_on_every_rank() -> None:
    sizes = [1000, 10, 10, 500, 500, 0, 0, 7]
    assigners = [ShareAssigner(actor_wg_world_size=3) for _ in range(2)]
    owners = [[assigner.owner(size) for size in sizes] for assigner in assigners]
    assert owners[0] == owners[1] == [0, 1, 2, 1, 2, 1, 2, 1]
    loads = [sum(size for size, owner in zip(sizes, owners[0]) if owner == rank) for rank in range(3)]
    assert loads == [1000, 517, 510]
    with pytest.raises(TopologyError):
        ShareAssigner(actor_wg_world_size=0)
    assert ps_rank(role="actor", rank=1, actor_wg_world_size=4) == 1
    assert ps_rank(role="rollout", rank=1, actor_wg_world_size=4) == 5


def test_set_digest_is_order_independent_and_additive_through_the_exchange() -> None:
    tensors = case_tensors("mixed", 0, 1 << 16)
    whole, forward, backward = SetDigest(), SetDigest(), SetDigest()
    for name, tensor in tensors:
        whole.add(name, tensor)
    for name, tensor in tensors[::2]:
        forward.add(name, tensor)
    for name, tensor in reversed(tensors[1::2]):
        backward.add(name, tensor)
    summed = [a + b + c for a, b, c in zip(Exchange.contribution(forward, version=7),
                                           Exchange.contribution(backward, version=None),
                                           Exchange.contribution(None, version=None))]
    exchange = Exchange.from_sum(summed)
    assert exchange == Exchange(digest=whole.hexdigest(), tensors=len(tensors), nbytes=whole.nbytes, version=7)
    flipped = SetDigest()
    for name, tensor in tensors:
        data = tensor.clone()
        if name == tensors[0][0]:
            data.view(-1).view(torch.uint8)[0] ^= 1
        flipped.add(name, data)
    assert flipped.hexdigest() != whole.hexdigest()
    with pytest.raises(TopologyError):
        Exchange.from_sum([1, 2, 3])


def test_topology_maps_every_worker_onto_one_parameter_server_world() -> None:
    metadata = WorldMetadata(
        actor=[{"mode": "p2p", "master_addr": "10.0.0.1", "master_port": 4000}, {"mode": "p2p"}],
        rollout=[{"mode": "p2p"}] * 3,
    )
    topology = KimiCheckpointEngine.build_topology(actor_wg_world_size=2, rollout_world_size=3, metadata=metadata)
    topology.check(actor_wg_world_size=2, rollout_world_size=3)
    assert topology.senders == (0, 1)
    assert [args["ps_rank"] for args in [*topology.actor, *topology.rollout]] == [0, 1, 2, 3, 4]
    assert {args["ps_world_size"] for args in [*topology.actor, *topology.rollout]} == {5}
    assert topology.rollout[0]["update_ranks"] == [2, 3, 4]
    with pytest.raises(TopologyError, match="disagree on the mode"):
        KimiCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=WorldMetadata(
            actor=[{"mode": "p2p", "master_addr": "a", "master_port": 1}], rollout=[{"mode": "broadcast"}]))
    with pytest.raises(TopologyError, match="master_addr"):
        KimiCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=0, metadata=WorldMetadata(
            actor=[{"mode": "broadcast"}], rollout=[]))


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError, match="mode"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, mode="ring")
    with pytest.raises(ConfigError, match="mem_fraction"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, mem_fraction=1.5)
    with pytest.raises(ConfigError, match="shared_memory_pool"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, shared_memory_pool="yes")
    with pytest.raises(ConfigError, match="unknown options"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, ring=3)
    with pytest.raises(RenamedKeywordError, match="actor_wg"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, trainer=object())
    with pytest.raises(ConfigError, match="timeout"):
        KimiCheckpointEngine(bucket_bytes=1 << 20, timeout=0)
    engine = KimiCheckpointEngine(bucket_bytes=1 << 20, mode="p2p", mem_fraction=0.5, shared_memory_pool=False,
                                  context=WorkerContext(role="actor", rank=0, node_id="n", host_ip="127.0.0.1"))
    metadata = engine.prepare()
    assert metadata["backend"] == "kimi" and metadata["mode"] == "p2p" and metadata["slots"] == 2
    assert metadata["master_addr"] == "127.0.0.1" and isinstance(metadata["master_port"], int)
    engine.close()


# -- how the engine is built ---------------------------------------------------------------------------------


def test_the_engine_composes_core_s_public_pieces_and_inherits_no_pipeline() -> None:
    # Its only core base holds settings; no core class that defines send_weights is among its bases.
    core_bases = [cls for cls in KimiCheckpointEngine.__mro__[1:] if cls.__module__.startswith("weightsync.core")]
    assert core_bases and not any("send_weights" in vars(cls) for cls in core_bases)
    engine = KimiCheckpointEngine(bucket_bytes=1 << 16)
    assert isinstance(engine, CheckpointEngine)
    engine.close()
    engine.close()  # idempotent
    # weightsync-kimi imports one module of core, and no private name of another distribution.
    imported: set[str] = set()
    private: list[str] = []
    for path in Path(weightsync.kimi.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("weightsync.kimi"):
                imported.add(node.module)
                private += [f"{node.module}.{alias.name}" for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert {module for module in imported if module.startswith("weightsync.core")} == {"weightsync.core.backend"}
    assert private == []


def test_build_topology_is_keyword_only_guarded_and_stamps_one_epoch() -> None:
    metadata = WorldMetadata(actor=[{"mode": "broadcast", "master_addr": "a", "master_port": 1}], rollout=[{}])
    parameters = inspect.signature(KimiCheckpointEngine.build_topology).parameters
    assert {parameter.kind for parameter in parameters.values()} == {inspect.Parameter.KEYWORD_ONLY}
    topology = KimiCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=metadata)
    epochs = {args["epoch"] for args in [*topology.actor, *topology.rollout]}
    assert len(epochs) == 1 and all(isinstance(epoch, str) and epoch for epoch in epochs)
    loose: Any = KimiCheckpointEngine.build_topology
    with pytest.raises(TypeError, match="keyword arguments only"):
        loose(1, 1, metadata)
    with pytest.raises(RenamedKeywordError, match="actor_wg_world_size"):
        loose(trainer_world_size=1, rollout_world_size=1, metadata=metadata)
    with pytest.raises(TopologyError, match="KimiCheckpointEngine.build_topology: rollout_world_size=2"):
        KimiCheckpointEngine.build_topology(actor_wg_world_size=1, rollout_world_size=2, metadata=metadata)
