"""NCCL backend on a machine without CUDA: the probe and its message, the import guard, the node-local topology, and
the shared accelerator collective code (what nccl and hccl instantiate) on the emulated accelerator, with real gloo
groups standing in for NCCL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.backends.placements import MixedPlacement, OnEmulatedDevice
from tests.devices import NEGATIVE_CONTROL_DELAY, emulated_device
from tests.plugins import backends_on_path
from tests.backends.nccl.accel_gloo import (
    SPEC, GlooAcceleratorEngine, HostBounceGroup, RecordingEngine, RecordingOps, RecordingTransport,
)
from weightsync.api.errors import BackendUnavailableError, ConfigError, RenamedKeywordError, TopologyError
from weightsync.api.registry import get_backend_spec, load_engine_class
from weightsync.api.testing import EngineConformance, case_tensors, place, raw_bytes
from weightsync.api.types import Topology, TransferReport, WorkerContext, WorldMetadata
from weightsync.core.backend import BucketCheckpointEngine, node_local_plan
from weightsync.core.pipeline import bounce
from weightsync.core.transports import device as device_module
from weightsync.core.transports.collective import device as devicecollective
from weightsync.core.transports.collective.group import GroupPlans, GroupSend
from weightsync.core.transports.plan import Idle, decode_plan

NO_CUDA = not torch.cuda.is_available()


# -- probe and import guard ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not NO_CUDA, reason="checks the message given where CUDA is missing")
def test_probe_explains_what_is_missing_and_loading_raises_backend_unavailable() -> None:
    spec = get_backend_spec("nccl")
    assert spec.devices == frozenset({"cuda"}) and spec.distribution == "weightsync-nccl"
    reason = spec.probe()
    assert reason is not None and ("without CUDA" in reason or "no CUDA device" in reason or "no NVIDIA driver" in reason)
    with pytest.raises(BackendUnavailableError, match="nccl.*cannot run here") as info:
        load_engine_class("nccl")
    assert info.value.reason == reason


@pytest.mark.skipif(not NO_CUDA, reason="checks the message given where CUDA is missing")
def test_building_the_engine_without_cuda_is_a_typed_error_not_an_import_error() -> None:
    from weightsync.nccl.engine import NcclCheckpointEngine

    with pytest.raises(BackendUnavailableError, match="install a CUDA build of torch|no CUDA device|no NVIDIA driver"):
        NcclCheckpointEngine(bucket_bytes=1 << 20)


def test_options_are_validated_where_given() -> None:
    with pytest.raises(ConfigError, match="relays must be one of none, node"):
        GlooAcceleratorEngine(bucket_bytes=1 << 20, relays="tree")
    with pytest.raises(ConfigError, match="device_index"):
        GlooAcceleratorEngine(bucket_bytes=1 << 20, device_index=-1)
    with pytest.raises(ConfigError, match="unknown options"):
        GlooAcceleratorEngine(bucket_bytes=1 << 20, stream_priority=1)


# -- topology ---------------------------------------------------------------------------------------------------


def test_node_local_plan_serves_each_node_from_its_first_actor_rank() -> None:
    plan = node_local_plan(actor_nodes=["a", "a", "b", "b"], rollout_nodes=["b", "a", "c", "b", "a"])
    # rollout 2 is on node c, which has no actor rank: actor rank 0 serves it across nodes.
    assert plan == {0: [1, 2, 4], 2: [0, 3]}
    assert node_local_plan(actor_nodes=["a", "b"], rollout_nodes=["a"]) == {0: [0]}
    assert node_local_plan(actor_nodes=["a"], rollout_nodes=[]) == {0: []}
    with pytest.raises(TopologyError):
        node_local_plan(actor_nodes=[], rollout_nodes=["a"])


def _metadata(actor_nodes: list[str], rollout_nodes: list[str], relays: str = "node") -> WorldMetadata:
    actor = [{"node_id": node, "relays": relays, "store_host": "10.0.0.1", "store_port": 2000 + rank}
             for rank, node in enumerate(actor_nodes)]
    rollout = [{"node_id": node, "relays": relays} for node in rollout_nodes]
    return WorldMetadata(actor=actor, rollout=rollout)  # type: ignore[arg-type]


def test_build_topology_with_node_relays() -> None:
    topology = GlooAcceleratorEngine.build_topology(
        actor_wg_world_size=3, rollout_world_size=3, metadata=_metadata(["a", "a", "b"], ["b", "a", "b"]))
    topology.check(actor_wg_world_size=3, rollout_world_size=3)
    assert topology.senders == (0, 2)
    actor = [decode_plan(args, GroupPlans, who="test") for args in topology.actor]
    rollout = [decode_plan(args, GroupPlans, who="test") for args in topology.rollout]
    assert actor[1].role == "idle"
    assert isinstance(actor[2], GroupSend) and (actor[2].group_rank, actor[2].group_size, actor[2].store_port) == (
        0, 3, 2002)
    assert [plan.sender for plan in rollout] == [2, 0, 2]
    assert [plan.group_rank for plan in rollout] == [1, 1, 2]
    epochs = {plan.epoch for plan in [*actor, *rollout]}
    assert len(epochs) == 1  # one membership-epoch token for everyone


def test_build_topology_without_relays_is_the_single_broadcast_group() -> None:
    topology = GlooAcceleratorEngine.build_topology(
        actor_wg_world_size=2, rollout_world_size=2, metadata=_metadata(["a", "b"], ["a", "b"], relays="none"))
    assert topology.senders == (0,)
    rollout = [decode_plan(args, GroupPlans, who="test") for args in topology.rollout]
    assert [plan.group_rank for plan in rollout] == [1, 2]
    actor = [decode_plan(args, GroupPlans, who="test") for args in topology.actor]
    assert actor[1] == Idle(epoch=actor[0].epoch)


def test_build_topology_rejects_inconsistent_metadata_and_old_keywords() -> None:
    mixed = _metadata(["a"], ["a"])
    mixed.rollout[0]["relays"] = "none"
    with pytest.raises(TopologyError, match="disagree on the relays option"):
        GlooAcceleratorEngine.build_topology(actor_wg_world_size=1, rollout_world_size=1, metadata=mixed)
    no_store = _metadata(["a", "b"], ["b"])
    del no_store.actor[1]["store_port"]
    with pytest.raises(TopologyError, match="actor rank 1 did not advertise a store"):
        GlooAcceleratorEngine.build_topology(actor_wg_world_size=2, rollout_world_size=1, metadata=no_store)
    old: dict[str, Any] = {"trainer_world_size": 1, "rollout_world_size": 1, "metadata": _metadata(["a"], ["a"])}
    with pytest.raises(RenamedKeywordError):
        GlooAcceleratorEngine.build_topology(**old)


# -- the shared collective code through its gloo instance ------------------------------------------------------------


@pytest.fixture(scope="module")
def test_backend_on_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Register the gloo instance here and, through a throwaway dist-info, in the harness's spawned workers."""
    with backends_on_path(tmp_path_factory.mktemp("plugin"), {SPEC.name: "tests.backends.nccl.accel_gloo:SPEC"}):
        yield SPEC.name


class TestAcceleratorEngineOnGloo(OnEmulatedDevice, EngineConformance):
    """The conformance suite, unchanged, over the accelerator engine on the emulated device (one sender, two
    receivers): sources and destinations on the device, buckets in device rings."""

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, test_backend_on_path: str) -> str:
        return test_backend_on_path


class TestAcceleratorEngineMixedDevices(MixedPlacement, TestAcceleratorEngineOnGloo):
    """Host and device tensors interleaved: host sources are copied into device buckets, device buckets into host
    destinations."""


def _in_threads(calls: list[tuple[Callable[..., None], tuple[Any, ...]]], timeout: float) -> None:
    threads = [threading.Thread(target=target, args=args) for target, args in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)


def _run_world(engine_class: type[BucketCheckpointEngine], actor_nodes: list[str], rollout_nodes: list[str],
               *, relays: str, case: str = "mixed", on_device: bool = True) -> tuple[Topology, list[Any], list[Any]]:
    """Every worker in a thread of this process, each with its own engine and gloo group (a whole lifecycle), the
    weights on the emulated device."""
    device = emulated_device()
    bucket_bytes = 1 << 16
    actors = [engine_class(bucket_bytes=bucket_bytes, relays=relays, timeout=60,
                           context=WorkerContext(role="actor", rank=rank, node_id=node))
              for rank, node in enumerate(actor_nodes)]
    rollouts = [engine_class(bucket_bytes=bucket_bytes, relays=relays, timeout=60,
                             context=WorkerContext(role="rollout", rank=rank, node_id=node))
                for rank, node in enumerate(rollout_nodes)]
    try:
        metadata = WorldMetadata(actor=[e.prepare() for e in actors], rollout=[e.prepare() for e in rollouts])
        topology = engine_class.build_topology(
            actor_wg_world_size=len(actors), rollout_world_size=len(rollouts), metadata=metadata)
        engines = [*actors, *rollouts]
        errors: list[BaseException] = []

        def init(engine: BucketCheckpointEngine, args: Any) -> None:
            try:
                engine.init_process_group(rank_args=args)
            except BaseException as exc:
                errors.append(exc)

        _in_threads([(init, (engine, args)) for engine, args in zip(engines, [*topology.actor, *topology.rollout])],
                    60)
        assert not errors, errors
        expected = {name: raw_bytes(tensor) for name, tensor in case_tensors(case, 1, bucket_bytes)}
        results: list[Any] = [None] * len(engines)

        def send(index: int, engine: BucketCheckpointEngine) -> None:
            weights = case_tensors(case, 1, bucket_bytes)
            weights = place(weights, device, "device") if on_device else weights
            results[index] = asyncio.run(engine.send_weights(weights, version=1))

        async def receive_all(engine: BucketCheckpointEngine) -> tuple[TransferReport | None, dict[str, bool]]:
            stream = engine.receive_weights()
            same = {}
            async for name, tensor in stream:
                same[name] = bool(torch.equal(raw_bytes(tensor), expected[name]))
            return stream.report, same

        def receive(index: int, engine: BucketCheckpointEngine) -> None:
            try:
                results[index] = asyncio.run(receive_all(engine))
            except BaseException as exc:
                results[index] = exc

        _in_threads([(send, (i, e)) for i, e in enumerate(actors)]
                    + [(receive, (len(actors) + i, e)) for i, e in enumerate(rollouts)], 120)
        return topology, results[:len(actors)], results[len(actors):]
    finally:
        for engine in [*actors, *rollouts]:
            engine.close()


def test_node_local_senders_deliver_the_whole_model_to_every_node() -> None:
    topology, senders, receivers = _run_world(
        GlooAcceleratorEngine, ["a", "a", "b"], ["b", "a", "c", "b"], relays="node")
    assert topology.senders == (0, 2)
    digests = {report.rank: report.digest for report in senders if report.buckets}
    assert set(digests) == {0, 2} and senders[1].buckets == 0  # actor rank 1 drained its stream, sent nothing
    for (report, same), args in zip(receivers, topology.rollout):
        assert report is not None and report.sender == decode_plan(args, GroupPlans, who="test").sender
        assert report.digest == digests[report.sender]
        assert same and all(same.values()) and len(same) == len(case_tensors("mixed", 1, 1 << 16))


def test_delta_updates_are_refused_with_buckets_on_the_device() -> None:
    # Deltas are compared and encoded in host memory; a device ring would silently send every update full.
    emulated_device()
    with pytest.raises(ConfigError, match="delta updates are compared and encoded in host memory"):
        GlooAcceleratorEngine(bucket_bytes=1 << 16, delta=True)
    GlooAcceleratorEngine(bucket_bytes=1 << 16).close()


def test_host_weights_are_uploaded_into_device_buckets_and_hashed_on_the_host(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """Host sources reach the device ring through pinned host buckets (one non-blocking copy each)."""
    uploads: list[int] = []
    real_send = bounce.Upload.send

    def counting_send(self: bounce.Upload, buffer: torch.Tensor, bucket: Any, stream: Any) -> None:
        uploads.append(bucket.nbytes)
        real_send(self, buffer, bucket, stream)

    monkeypatch.setattr(bounce.Upload, "send", counting_send)
    _, senders, receivers = _run_world(GlooAcceleratorEngine, ["a"], ["a", "a"], relays="none", case="many_small",
                                       on_device=False)
    assert len(uploads) == senders[0].buckets >= 2
    for report, same in receivers:
        assert report is not None and report.digest == senders[0].digest
        assert same and all(same.values())


def test_copy_and_comm_streams_are_ordered_by_events_only() -> None:
    topology, senders, receivers = _run_world(RecordingEngine, ["a"], ["a"], relays="none")
    assert senders[0].buckets >= 2 and receivers[0][0] is not None
    # The sender's ops: broadcasts wait on "packed" (recorded on the copy stream), packing waits on "sent".
    sender_ops: RecordingOps = RecordingTransport.last_ops["actor"]
    copy_stream, comm_stream = "stream1", "stream3"  # made in this order: copy, staging, comm
    packed = {event for kind, event, stream in sender_ops.calls if kind == "record" and stream == copy_stream}
    waited = {event for kind, stream, event in sender_ops.calls if kind == "wait_event" and stream == comm_stream}
    assert packed and packed <= waited
    sent = {event for kind, event, stream in sender_ops.calls if kind == "record" and stream == comm_stream}
    assert {event for kind, stream, event in sender_ops.calls if kind == "wait_event" and stream == copy_stream} <= sent
    assert any(kind == "wait_event" and stream == copy_stream for kind, stream, _ in sender_ops.calls)


def test_a_missing_wait_for_a_received_bucket_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a receiver that hands a bucket over before its copy to the device has run gives its
    consumer old bytes; the byte comparison or the digest must notice. (The emulator delays every copy, the
    consumer's reads too: the landing copy is made slower than they are.)"""
    real_wait = device_module.wait_event

    def skip_the_bucket_wait(ops: Any, event: Any, deadline: float, *, peer: str, what: str) -> None:
        if what != "a bucket":
            real_wait(ops, event, deadline, peer=peer, what=what)

    monkeypatch.setattr(devicecollective, "wait_event", skip_the_bucket_wait)
    monkeypatch.setattr(HostBounceGroup, "landing_delay", NEGATIVE_CONTROL_DELAY)
    _, senders, receivers = _run_world(GlooAcceleratorEngine, ["a"], ["a"], relays="none")
    assert senders[0].buckets >= 2
    result = receivers[0]
    assert isinstance(result, BaseException) or not all(result[1].values())


# -- device -------------------------------------------------------------------------------------------------------


@pytest.mark.device
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL conformance needs two CUDA devices (run "
                    "tools/gpu-check/gpu_check.py on a GPU machine)")
class TestNcclConformance(EngineConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        return "nccl"

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return 1
