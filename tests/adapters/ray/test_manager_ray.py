"""The manager driving real Ray actors with the real shm and gloo transports."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import prometheus_client
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from weightsync.api.config import SyncConfig
from weightsync.api.errors import (
    ConcurrentUpdateError,
    ConfigError,
    DestinationError,
    DigestMismatchError,
    DuplicateTensorError,
    RenamedKeywordError,
    TopologyError,
    UnknownBackendError,
    WeightStreamError,
)
from weightsync.api.types import Topology, WorldMetadata
from weightsync.core.control import steps as steps_module
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica
from weightsync.shm.engine import ShmCheckpointEngine

from tests.conftest import RayNodes
from tests.liveness import measure_liveness
from tests.workloads import CountingModelSource, CountingSink, model_tensors, weights_digest

BUCKET = 256 * 1024


@dataclass
class World:
    actor_wg: RayActorWorkerGroup
    replicas: list[RayRolloutReplica]

    def manager(self, backend: str, **config: Any) -> CheckpointEngineManager:
        return CheckpointEngineManager(
            backend=backend, actor_wg=self.actor_wg, replicas=self.replicas,
            config=SyncConfig(bucket_bytes=config.pop("bucket_bytes", BUCKET), **config),
        )

    def set_mode(self, mode: str, delay: float = 0.0) -> None:
        ray.get(self.actor_wg.call("set_mode", mode, delay))

    def set_version(self, version: int) -> str:
        digests = ray.get(self.actor_wg.call("set_version", version))
        return str(digests[0])

    def set_loading(self, loading: str) -> None:
        ray.get([ref for replica in self.replicas for ref in replica.call("set_loading", loading)])

    def sink_digests(self) -> list[str]:
        return [ray.get(ref) for replica in self.replicas for ref in replica.call("digest")]

    def hooks(self, replica: int) -> list[str]:
        return list(ray.get(self.replicas[replica].call("hook_log")[0]))

    def pg_constructions(self, replicas: list[RayRolloutReplica] | None = None) -> int:
        refs = self.actor_wg.call("pg_constructions")
        refs += [ref for replica in replicas or self.replicas for ref in replica.call("pg_constructions")]
        return sum(ray.get(refs))


@pytest.fixture(scope="module")
def world(ray_nodes: RayNodes) -> Iterator[World]:
    actor_wg = RayActorWorkerGroup.create(world_size=2, source_factory=CountingModelSource, node_id=ray_nodes.head)
    replicas = [
        RayRolloutReplica.create(replica=index, sink_factory=CountingSink, node_id=ray_nodes.head)
        for index in range(2)
    ]
    world = World(actor_wg, replicas)
    try:
        yield world
    finally:
        actor_wg.shutdown()
        for replica in replicas:
            replica.shutdown()


@pytest.fixture(autouse=True)
def normal_mode(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "world" in request.fixturenames:
        request.getfixturevalue("world").set_mode("normal")
        request.getfixturevalue("world").set_loading("views")


def shm_entries() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("weightsync-")}


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_updates_are_bit_exact_and_replicas_resume(world: World, backend: str) -> None:
    manager = world.manager(backend)
    for version in (11, 12):
        expected = world.set_version(version)
        report = asyncio.run(manager.update_weights(version=version))
        assert world.sink_digests() == [expected, expected]
        assert [outcome.state for outcome in report.replicas] == ["committed", "committed"]
        assert all(outcome.resumed for outcome in report.replicas)
        assert report.nbytes == sum(t.numel() * t.element_size() for _, t in model_tensors(version))
    assert list(manager.status()) == list(report.replicas)  # status() is the last update's ReplicaOutcome
    assert [status.version for status in manager.status()] == [12, 12]
    assert world.hooks(0)[-4:] == ["abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation"]


def test_second_update_reuses_shm_segments(world: World) -> None:
    manager = world.manager("shm")
    world.set_version(21)
    asyncio.run(manager.update_weights())
    after_first = shm_entries()
    assert len(after_first) >= 2  # the ring exists (positive control for the check below)
    world.set_version(22)
    report = asyncio.run(manager.update_weights())
    assert not report.rebuilt
    assert shm_entries() == after_first
    # Negative control: a different bucket size makes every host build a new engine, and the set changes.
    other = world.manager("shm", bucket_bytes=2 * BUCKET)
    asyncio.run(other.update_weights())
    assert shm_entries() != after_first


def test_second_update_reuses_gloo_groups(world: World) -> None:
    manager = world.manager("gloo")
    world.set_version(31)
    asyncio.run(manager.update_weights())
    after_first = world.pg_constructions()
    assert after_first >= 3  # sender + two receivers built groups (the counter sees constructions)
    world.set_version(32)
    asyncio.run(manager.update_weights())
    assert world.pg_constructions() == after_first
    # Negative control: a membership change rebuilds the groups, and the counter grows.
    everyone = list(world.replicas)
    replica = world.replicas.pop()
    manager.remove_replicas([replica])
    try:
        asyncio.run(manager.update_weights())
        assert world.pg_constructions(everyone) > after_first
    finally:
        world.replicas.append(replica)


def test_manager_never_blocks_its_event_loop(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = world.manager("shm")
    world.set_mode("normal", delay=0.2)  # 12 tensors x 0.2 s: an update of about 2.4 s
    ticks, worst, seconds = asyncio.run(measure_liveness(lambda: manager.update_weights()))
    assert seconds >= 2.0
    assert ticks >= 100 and worst < 0.2, (ticks, worst)

    # Negative control: the same check against a manager that calls ray.get inside the update must fail.
    original = steps_module.gather

    async def blocking_gather(step: str, timeout: float, labelled: list[tuple[str, Any]], **kwargs: Any) -> Any:
        # Ray ObjectRefs are fetched with ray.get, which blocks the loop, as verl's manager did.
        resolved = [
            (label, _done(ray.get(awaitable)) if isinstance(awaitable, ray.ObjectRef) else awaitable)
            for label, awaitable in labelled
        ]
        return await original(step, timeout, resolved, **kwargs)

    monkeypatch.setattr(steps_module, "gather", blocking_gather)
    ticks, worst, seconds = asyncio.run(measure_liveness(lambda: manager.update_weights()))
    assert seconds >= 2.0
    assert not (ticks >= 100 and worst < 0.2), (ticks, worst)


async def _done(value: Any) -> Any:
    return value


def test_duplicate_tensor_name_is_a_typed_error(world: World) -> None:
    manager = world.manager("shm")
    world.set_mode("duplicate")
    with pytest.raises(DuplicateTensorError, match="appears twice"):
        asyncio.run(manager.update_weights())
    world.set_mode("normal")
    expected = world.set_version(41)
    asyncio.run(manager.update_weights())  # the failed update left nothing behind
    assert world.sink_digests() == [expected, expected]


def test_non_tensor_in_stream_is_a_typed_error(world: World) -> None:
    manager = world.manager("gloo")
    world.set_mode("non_tensor")
    with pytest.raises(WeightStreamError, match="not a tensor"):
        asyncio.run(manager.update_weights())


def test_unknown_backend_names_the_package(world: World, hide_backend: Any) -> None:
    hide_backend("nixl")
    with pytest.raises(UnknownBackendError, match="pip install weightsync-nixl"):
        CheckpointEngineManager(backend="nixl", actor_wg=world.actor_wg, replicas=world.replicas)
    with pytest.raises(UnknownBackendError, match="known backends"):
        CheckpointEngineManager(backend="carrier-pigeon", actor_wg=world.actor_wg, replicas=world.replicas)


def test_old_trainer_keyword_names_the_new_one(world: World) -> None:
    old_style: dict[str, Any] = {"trainer": world.actor_wg}
    with pytest.raises(RenamedKeywordError, match="actor_wg=.*weightsync migrate"):
        CheckpointEngineManager(backend="shm", replicas=world.replicas, **old_style)
    with pytest.raises(TypeError):
        CheckpointEngineManager(backend="shm", replicas=world.replicas, **old_style)
    # Also next to actor_wg= (mypy rejects both calls: tests/typing/check_actor_wg_keywords.py).
    with pytest.raises(RenamedKeywordError, match="actor_wg=.*weightsync migrate"):
        CheckpointEngineManager(backend="shm", actor_wg=world.actor_wg, replicas=world.replicas, **old_style)
    unknown: dict[str, Any] = {"actor_group": world.actor_wg}
    with pytest.raises(TypeError, match="actor_group"):
        CheckpointEngineManager(backend="shm", actor_wg=world.actor_wg, replicas=world.replicas, **unknown)


class _ShortTopologyEngine:
    """The driver's view of an engine class (only build_topology is called there) that drops a rollout entry."""

    @classmethod
    def build_topology(cls, *, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: WorldMetadata) -> Topology:
        full = ShmCheckpointEngine.build_topology(actor_wg_world_size=actor_wg_world_size,
                                                  rollout_world_size=rollout_world_size, metadata=metadata)
        return Topology(actor=full.actor, rollout=full.rollout[:-1], senders=full.senders)


def test_topology_not_matching_world_sizes_is_rejected(world: World) -> None:
    manager = world.manager("shm")
    manager.engine_class = cast(Any, _ShortTopologyEngine)
    seen = [len(world.hooks(r)) for r in range(2)]
    with pytest.raises(TopologyError, match="1 rollout entries but rollout_world_size is 2"):
        asyncio.run(manager.update_weights())
    # Nothing moved: the topology is built before any replica is paused, so they served throughout.
    assert [len(world.hooks(r)) for r in range(2)] == seen
    assert [state.state for state in manager.status()] == ["untouched", "untouched"]


def test_corrupted_bucket_is_caught_by_digest_and_repaired(world: World) -> None:
    manager = world.manager("shm", backend_options={"transport_hook": "tests.workloads:FLIP_ONCE"})
    world.set_version(51)
    with pytest.raises(DigestMismatchError):
        asyncio.run(manager.update_weights())
    states = [status.state for status in manager.status()]
    assert "torn" in states
    torn = states.index("torn")
    assert not manager.status()[torn].resumed and "DigestMismatchError" in str(manager.status()[torn].error)
    assert world.hooks(torn)[-2:] == ["abort_all_requests", "release_kv_cache"]  # still paused
    expected = world.set_version(52)
    report = asyncio.run(manager.update_weights())  # the hook flips once per process: this one is clean
    assert [outcome.state for outcome in report.replicas] == ["committed", "committed"]
    assert world.sink_digests() == [expected, expected]
    assert world.hooks(torn)[-2:] == ["resume_kv_cache", "resume_generation"]


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_a_destination_refused_before_any_write_leaves_the_replica_untouched(world: World, backend: str) -> None:
    manager = world.manager(backend)
    expected = world.set_version(61)
    asyncio.run(manager.update_weights())  # every sink now holds every tensor: its copy_into destinations
    world.set_version(62)
    world.set_loading("refuse_all")
    with pytest.raises(DestinationError):
        asyncio.run(manager.update_weights())
    # Untouched: each replica holds, committed, the version it held, and serves it again.
    assert [(status.state, status.version, status.resumed)
            for status in manager.status()] == [("committed", 1, True)] * 2
    assert world.sink_digests() == [expected, expected]  # read from the sinks: they hold what they held
    assert world.hooks(0)[-2:] == ["resume_kv_cache", "resume_generation"]
    # Negative control: refused after the stream's other tensors were written, the replicas are torn and paused.
    world.set_loading("refuse_last")
    with pytest.raises(DestinationError):
        asyncio.run(manager.update_weights())
    assert [(status.state, status.resumed) for status in manager.status()] == [("torn", False)] * 2
    assert world.sink_digests() != [expected, expected]
    world.set_loading("copy_into")
    expected = world.set_version(63)
    report = asyncio.run(manager.update_weights())
    assert [outcome.state for outcome in report.replicas] == ["committed", "committed"]
    assert world.sink_digests() == [expected, expected]


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the Prometheus endpoint at ``port``, read over HTTP as a scraper reads it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_each_update_logs_a_record_and_is_scraped_from_prometheus(world: World,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1")
    try:
        port = server.server_port
        committed = ("weightsync:weight_updates_total", (("outcome", "committed"),))
        failed = ("weightsync:weight_updates_total", (("outcome", "failed"),))
        model_bytes = ("weightsync:weight_update_bytes_total", (("kind", "model"),))
        transfers = ("weightsync:weight_update_duration_seconds_count", (("operation", "transfer"),))
        manager = world.manager("shm")
        world.set_version(71)
        asyncio.run(manager.update_weights())  # the epoch: built before the figures below are read
        before = _scrape(port)
        caplog.set_level(logging.DEBUG, logger="weightsync")
        world.set_version(72)
        report = asyncio.run(manager.update_weights())
        after = _scrape(port)
        records = [record for record in caplog.records if record.name == "weightsync.core.control.telemetry"]
        assert [record.levelno for record in records] == [logging.INFO]
        line = records[0].getMessage()
        assert f"update {report.version}: backend shm, {report.nbytes} bytes" in line and "2 committed" in line
        assert any(record.getMessage().startswith("step transfer: 4 workers") for record in caplog.records)
        assert after[committed] == before.get(committed, 0) + 1 and after.get(failed, 0) == before.get(failed, 0)
        assert after[model_bytes] == before[model_bytes] + report.nbytes
        assert after[transfers] == before[transfers] + 1
        assert after[("weightsync:weight_update_operations_in_flight", ())] == 0
        assert after[("weightsync:replicas", (("state", "committed"),))] == 2
        metrics = report.metrics()
        assert metrics["weightsync/pause_s_max"] == max(outcome.pause_seconds for outcome in report.replicas) > 0
        assert metrics["weightsync/replicas_committed"] == 2 and metrics["weightsync/bytes"] == report.nbytes
        # Negative control: a failed update is a WARNING, counted as failed and not as committed.
        caplog.clear()
        world.set_mode("raise_midway")
        with pytest.raises(Exception, match="half-way"):
            asyncio.run(manager.update_weights())
        failure = _scrape(port)
        records = [record for record in caplog.records if record.name == "weightsync.core.control.telemetry"]
        assert [record.levelno for record in records] == [logging.WARNING]
        assert failure[failed] == after.get(failed, 0) + 1 and failure[committed] == after[committed]
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_backend_options_are_checked_when_the_manager_is_built(world: World) -> None:
    seen = [len(world.hooks(r)) for r in range(2)]
    with pytest.raises(ConfigError, match=r"\['fanuot'\] are not options of backend 'tcp'; its options: .*fanout"):
        world.manager("tcp", backend_options={"fanuot": 2})
    # Under auto, against every backend it may pick: shm has no chain layout.
    with pytest.raises(ConfigError, match=r"\['layout'\] are not options of backend 'shm' \(one backend='auto'"):
        world.manager("auto", backend_options={"layout": "two_level"})
    assert [len(world.hooks(r)) for r in range(2)] == seen  # nothing reached a replica
    # Negative control: options every engine takes are accepted, under a named backend and under auto.
    world.manager("tcp", backend_options={"fanout": 2, "transport_hook": "tests.workloads:FLIP_ONCE"})
    world.manager("auto", backend_options={"transport_hook": "tests.workloads:FLIP_ONCE"})


def test_bad_arguments_raise_at_the_call(world: World) -> None:
    manager = world.manager("shm")
    with pytest.raises(ConfigError):
        SyncConfig(bucket_bytes=0)
    with pytest.raises(ConfigError):
        asyncio.run(manager.update_weights(version=-1))

    async def two_at_once() -> None:
        first = asyncio.create_task(manager.update_weights())
        await asyncio.sleep(0)
        try:
            with pytest.raises(ConcurrentUpdateError):
                await manager.update_weights()
        finally:
            await first

    asyncio.run(two_at_once())


def check_phase_order(clocks: list[list[tuple[str, float]]], first: str, second: str) -> None:
    firsts = [at for clock in clocks for hook, at in clock if hook == first]
    seconds = [at for clock in clocks for hook, at in clock if hook == second]
    if len(firsts) != len(clocks) or len(seconds) != len(clocks):
        raise AssertionError(f"expected one {first} and one {second} per worker: {clocks}")
    if max(firsts) >= min(seconds):
        raise AssertionError(f"a worker ran {second} before every worker ran {first}: {clocks}")


class _ClockedWorker:
    """A rollout worker whose ``init_process_group`` calls are timed as they return (this host's CLOCK_MONOTONIC,
    as the sinks' own hook clocks)."""

    def __init__(self, inner: Any, returned: list[float]) -> None:
        self._inner, self._returned = inner, returned

    @property
    def name(self) -> str:
        return str(self._inner.name)

    def execute_checkpoint_engine(self, method: str, /, **kwargs: Any) -> Any:
        return _clocked(self._inner.execute_checkpoint_engine(method, **kwargs), method, self._returned)

    def update_weights(self, *, version: int) -> Any:
        return self._inner.update_weights(version=version)


class _ClockedReplica:
    """A ``RayRolloutReplica`` seen through :class:`_ClockedWorker`s; its pause and resume go to it unchanged."""

    def __init__(self, inner: RayRolloutReplica, returned: list[float]) -> None:
        self._inner = inner
        self.workers = [_ClockedWorker(worker, returned) for worker in inner.workers]

    async def pause(self) -> None:
        await self._inner.pause()

    async def resume(self) -> None:
        await self._inner.resume()

    async def abort_all_requests(self) -> None:
        await self._inner.abort_all_requests()

    async def release_kv_cache(self) -> None:
        await self._inner.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self._inner.resume_kv_cache()

    async def resume_generation(self) -> None:
        await self._inner.resume_generation()


async def _clocked(call: Any, method: str, returned: list[float]) -> Any:
    result = await call
    if method == "init_process_group":
        returned.append(time.monotonic())
    return result


def check_setup_before_pause(setup_returned: list[float], clocks: list[list[tuple[str, float]]]) -> None:
    """Every replica's own pause (its sinks' first ``abort_all_requests``) came after every worker's
    ``init_process_group`` had returned."""
    pauses = [at for clock in clocks for hook, at in clock if hook == "abort_all_requests"]
    if not setup_returned or len(pauses) != len(clocks):
        raise AssertionError(f"expected setup calls and one pause per worker: {setup_returned}, {clocks}")
    if min(pauses) <= max(setup_returned):
        raise AssertionError(f"a replica was paused at {min(pauses):.3f}, before setup ended at "
                             f"{max(setup_returned):.3f}")


def test_setup_runs_before_any_replica_is_paused(world: World) -> None:
    """An update that builds its epoch does so while the replicas serve: each replica's own pause log starts after
    the last worker's ``init_process_group`` returned, and its ``pause_seconds`` leave the setup out."""
    returned: list[float] = []
    clocked = [_ClockedReplica(replica, returned) for replica in world.replicas]
    manager = CheckpointEngineManager(backend="shm", actor_wg=world.actor_wg, replicas=clocked,
                                      config=SyncConfig(bucket_bytes=BUCKET))
    before = [len(ray.get(replica.call("hook_clock")[0])) for replica in world.replicas]
    world.set_version(31)
    report = asyncio.run(manager.update_weights())
    assert report.rebuilt and len(returned) == 2  # both rollout workers joined the new epoch
    clocks = [list(ray.get(replica.call("hook_clock")[0]))[seen:] for replica, seen in zip(world.replicas, before)]
    check_setup_before_pause(returned, clocks)
    for outcome, clock in zip(report.replicas, clocks):
        times = dict(clock)
        assert outcome.resumed and times["resume_generation"] - times["abort_all_requests"] <= outcome.pause_seconds
        assert outcome.pause_seconds < report.seconds - report.stages["setup"]


def test_setup_before_pause_check_can_fail() -> None:
    # Negative control: the pause came first (as when the epoch was built inside the pause).
    with pytest.raises(AssertionError, match="before setup ended"):
        check_setup_before_pause([2.0, 2.5], [[("abort_all_requests", 1.0)], [("abort_all_requests", 3.0)]])
    check_setup_before_pause([2.0, 2.5], [[("abort_all_requests", 2.6)], [("abort_all_requests", 3.0)]])


def test_phase_order_check_can_fail() -> None:
    # Negative control: worker 1 releases its cache before worker 0 has stopped generating.
    with pytest.raises(AssertionError, match="before every worker"):
        check_phase_order([[("abort_all_requests", 2.0), ("release_kv_cache", 3.0)],
                           [("abort_all_requests", 0.5), ("release_kv_cache", 1.0)]],
                          "abort_all_requests", "release_kv_cache")
    check_phase_order([[("abort_all_requests", 1.0), ("release_kv_cache", 3.0)],
                       [("abort_all_requests", 0.5), ("release_kv_cache", 2.0)]],
                      "abort_all_requests", "release_kv_cache")


def test_multi_worker_replicas(ray_nodes: RayNodes) -> None:
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=CountingModelSource, node_id=ray_nodes.head)
    replica = RayRolloutReplica.create(replica=0, sink_factory=CountingSink, num_workers=3, node_id=ray_nodes.head)
    try:
        manager = CheckpointEngineManager(backend="gloo", actor_wg=actor_wg, replicas=[replica],
                                          config=SyncConfig(bucket_bytes=BUCKET))
        report = asyncio.run(manager.update_weights())
        assert report.receivers == 3
        expected = weights_digest(model_tensors(1))
        assert ray.get(replica.call("digest")) == [expected] * 3
        # Across the replica's workers, no worker drops its KV cache before every worker stopped generating, and
        # none generates again before every worker has its KV cache back.
        clocks = [list(map(tuple, clock)) for clock in ray.get(replica.call("hook_clock"))]
        check_phase_order(clocks, "abort_all_requests", "release_kv_cache")
        check_phase_order(clocks, "resume_kv_cache", "resume_generation")
    finally:
        actor_wg.shutdown()
        replica.shutdown()


def test_auto_is_the_default_and_picks_shm_on_one_host(world: World) -> None:
    manager = CheckpointEngineManager(actor_wg=world.actor_wg, replicas=world.replicas,
                                      config=SyncConfig(bucket_bytes=BUCKET))
    assert manager.backend == "auto"
    expected = world.set_version(31)
    report = asyncio.run(manager.update_weights(version=31))
    assert report.ok and world.sink_digests() == [expected, expected]
    assert report.backend == "shm" and report.chosen == "shm: every worker shares the sender's host"  # the one that ran
    assert manager.choice is not None and manager.choice.backend == "shm"
    sender = int(ray.get(world.actor_wg.call("pid")[0]))
    assert any(name.startswith(f"weightsync-{sender}-") for name in shm_entries())  # the sender's shm ring
