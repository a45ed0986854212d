"""The kimi backend: our calls against checkpoint-engine's real signatures, the pure mapping, and the lifecycle
against a fake ParameterServer world (threads) that records every call."""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import inspect
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

from weightsync.api.errors import BackendUnavailableError, ConfigError, DigestMismatchError, TopologyError
from weightsync.api.registry import get_backend_spec, load_engine_class
from weightsync.api.testing import case_tensors, raw_bytes
from weightsync.api.types import TransferReport, WorkerContext, WorldMetadata
from weightsync.kimi.engine import KimiCheckpointEngine
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
    inspect.signature(ce_dist.all_reduce).bind(torch.zeros(1), op=torch.distributed.ReduceOp.SUM)
    inspect.signature(ce_dist.destroy_process_group).bind()
    inspect.signature(ce_dist.is_initialized).bind()
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


# -- the lifecycle against a fake ParameterServer world ------------------------------------------------------------


class FakeWorld:
    """The shared state of a fake checkpoint-engine world: registered shares, collectives, a call log."""

    def __init__(self, size: int, *, corrupt: bool = False) -> None:
        self.size = size
        self.corrupt = corrupt
        self.barrier = threading.Barrier(size, timeout=30)
        self.lock = threading.Lock()
        self.shares: dict[int, dict[str, torch.Tensor]] = {}
        self.calls: list[tuple[int, str, dict[str, Any]]] = []
        self._sums: dict[int, list[int]] = {}
        self._reduce_calls = [0] * size

    def log(self, who: int, method: str, **arguments: Any) -> None:
        with self.lock:
            self.calls.append((who, method, arguments))

    def all_reduce(self, rank: int, values: list[int]) -> list[int]:
        with self.lock:
            self._reduce_calls[rank] += 1
            key = self._reduce_calls[rank]
            total = self._sums.setdefault(key, [0] * len(values))
            self._sums[key] = [a + b for a, b in zip(total, values)]
        self.barrier.wait()
        return list(self._sums[key])

    def buckets(self) -> list[list[tuple[str, torch.Tensor]]]:
        items = [(name, tensor) for rank in sorted(self.shares) for name, tensor in self.shares[rank].items()]
        return [items[start:start + 3] for start in range(0, len(items), 3)]


class FakeParameterServer:
    def __init__(self, world: FakeWorld, **kwargs: Any) -> None:
        self.world = world
        self.rank = int(kwargs["rank"])
        world.log(self.rank, "__init__", **kwargs)

    def init_process_group(self, *, timeout: datetime.timedelta) -> None:
        self.world.log(self.rank, "init_process_group", timeout=timeout)

    def register_checkpoint(self, checkpoint_name: str, *, named_tensors: dict[str, torch.Tensor],
                            use_shared_memory_pool: bool = False) -> None:
        self.world.log(self.rank, "register_checkpoint", name=checkpoint_name, names=sorted(named_tensors),
                       use_shared_memory_pool=use_shared_memory_pool)
        with self.world.lock:
            self.world.shares[self.rank] = {name: tensor.clone() for name, tensor in named_tensors.items()}

    def gather_metas(self, checkpoint_name: str) -> None:
        self.world.log(self.rank, "gather_metas", name=checkpoint_name)
        self.world.barrier.wait()

    def update(self, checkpoint_name: str, req_func: Callable[[list[tuple[str, str]]], None], *,
               timeout: datetime.timedelta, ranks: list[int] | None = None) -> None:
        self.world.log(self.rank, "update", name=checkpoint_name, ranks=ranks)
        if not ranks or self.rank in ranks:
            paths = [(f"GPU-{rank}", f"ipc://fake-{rank}") for rank in range(self.world.size)]
            thread = threading.Thread(target=req_func, args=(paths,))
            thread.start()
            thread.join(30)
        self.world.barrier.wait()

    def unregister_checkpoint(self, checkpoint_name: str, force: bool = False) -> None:
        self.world.log(self.rank, "unregister_checkpoint", name=checkpoint_name, force=force)


class FakeKimiEngine(KimiCheckpointEngine):
    world: ClassVar[FakeWorld]

    def _new_parameter_server(self, **kwargs: Any) -> Any:
        return FakeParameterServer(self.world, **kwargs)

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        return self.world.all_reduce(int(str(self._rank_args["ps_rank"])), values)

    def _device_uuid(self) -> str:
        return f"GPU-{self._rank_args['ps_rank']}"

    def _serve_ipc(self, handle: str, run: Callable[[list[tuple[str, torch.Tensor]]], None]) -> None:
        assert handle == f"ipc://fake-{self._rank_args['ps_rank']}"
        for index, bucket in enumerate(self.world.buckets()):
            buffer = [(name, tensor.clone()) for name, tensor in bucket]
            if self.world.corrupt and self.context.role == "rollout" and index == 1:
                buffer[0][1].view(-1).view(torch.uint8)[0] ^= 0xFF
            run(buffer)
            for _, tensor in buffer:
                tensor.fill_(0)  # the IPC buffer is reused after run() returns: a kept view would see this


def _run(actors: int, rollouts: int, *, mode: str = "broadcast", corrupt: bool = False
         ) -> tuple[FakeWorld, list[Any], list[Any]]:
    FakeKimiEngine.world = world = FakeWorld(actors + rollouts, corrupt=corrupt)
    engines = [FakeKimiEngine(bucket_bytes=1 << 16, mode=mode, timeout=30,
                              context=WorkerContext(role="actor", rank=rank, node_id="n")) for rank in range(actors)]
    engines += [FakeKimiEngine(bucket_bytes=1 << 16, mode=mode, timeout=30,
                               context=WorkerContext(role="rollout", rank=rank, node_id="n")) for rank in range(rollouts)]
    metadata = WorldMetadata(actor=[e.prepare() for e in engines[:actors]],
                             rollout=[e.prepare() for e in engines[actors:]])
    topology = FakeKimiEngine.build_topology(actor_wg_world_size=actors, rollout_world_size=rollouts,
                                             metadata=metadata)
    for engine, args in zip(engines, [*topology.actor, *topology.rollout]):
        engine.init_process_group(rank_args=args)
    expected = {name: raw_bytes(tensor) for name, tensor in case_tensors("mixed", 2, 1 << 16)}
    results: list[Any] = [None] * len(engines)

    async def receive(engine: FakeKimiEngine) -> tuple[TransferReport | None, dict[str, bool]]:
        stream = engine.receive_weights()
        same = {}
        async for name, tensor in stream:
            same[name] = bool(torch.equal(raw_bytes(tensor), expected[name]))
        return stream.report, same

    def work(index: int, engine: FakeKimiEngine) -> None:
        try:
            if engine.context.role == "actor":
                results[index] = asyncio.run(engine.send_weights(case_tensors("mixed", 2, 1 << 16), version=2))
            else:
                results[index] = asyncio.run(receive(engine))
            engine.finalize()
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=work, args=(index, engine)) for index, engine in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for engine in engines:
        engine.close()
    return world, results[:actors], results[actors:]


def test_broadcast_update_through_the_fake_parameter_server() -> None:
    world, senders, receivers = _run(2, 2)
    names = {name for name, _ in case_tensors("mixed", 2, 1 << 16)}
    shares = [set(next(args["names"] for rank, method, args in world.calls
                       if rank == actor and method == "register_checkpoint")) for actor in range(2)]
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == names
    assert not [call for call in world.calls if call[1] == "register_checkpoint" and call[0] >= 2]
    inits = [args for _, method, args in world.calls if method == "__init__"]
    assert all(args["auto_pg"] is False and args["world_size"] == 4 for args in inits)
    assert sorted(args["rank"] for args in inits) == [0, 1, 2, 3]
    updates = [(rank, args["ranks"]) for rank, method, args in world.calls if method == "update"]
    assert sorted(updates) == [(0, None), (1, None), (2, None), (3, None)]
    assert all(isinstance(report, TransferReport) for report in senders), senders
    digests = {report.digest for report in senders}
    assert len(digests) == 1  # every actor rank reports the whole update's digest
    for report, same in receivers:
        assert report is not None and report.digest in digests and report.version == 2 and report.sender == 0
        assert set(same) == names and all(same.values())  # views were read before the buffer was reused
    unregistered = [args for rank, method, args in world.calls if method == "unregister_checkpoint"]
    assert {args["force"] for args in unregistered} == {False, True}  # finalize keeps the pool, close frees it


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mode='p2p' needs Mooncake installed")
def test_p2p_update_names_the_rollout_ranks() -> None:
    world, senders, receivers = _run(1, 2, mode="p2p")
    updates = sorted((rank, args["ranks"]) for rank, method, args in world.calls if method == "update")
    assert updates == [(0, [1, 2]), (1, [1, 2]), (2, [1, 2])]
    assert all(report is not None for report, _ in receivers), receivers


def test_corruption_in_transit_is_a_digest_mismatch() -> None:
    _, senders, receivers = _run(1, 1, corrupt=True)
    assert isinstance(receivers[0], DigestMismatchError), receivers


def test_a_process_with_a_default_group_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = KimiCheckpointEngine(bucket_bytes=1 << 16, context=WorkerContext(role="actor", rank=0, node_id="n"))
    args = {"role": "sender", "ps_rank": 0, "ps_world_size": 2, "master_addr": "127.0.0.1", "master_port": 1,
            "actor_wg_world_size": 1, "epoch": "e"}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(BackendUnavailableError, match="default torch.distributed group"):
        engine.init_process_group(rank_args=args)  # type: ignore[arg-type]
    engine.close()


@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="checkpoint-engine's ParameterServer needs a CUDA GPU "
                    "per worker: two GPUs at least")
def test_kimi_on_gpus() -> None:
    from weightsync.api.testing import EngineHarness

    harness = EngineHarness("kimi", receivers=1, bucket_bytes=1 << 20)
    harness.start()
    try:
        harness.setup()
        harness.update("mixed", 1)
    finally:
        harness.close()
