"""Each worker its part: replicas of two tensor-parallel workers (``RayRolloutReplica.create(parts=...)``), each
holding half of every split tensor; full, delta and staged updates over shm; what each worker hashes, counted by
wrapping the hash library in its process; a corrupted byte only one rank holds."""

from __future__ import annotations

import asyncio
import glob
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import ray
from weightsync.api.config import SyncConfig
from weightsync.api.errors import DigestMismatchError, PartMismatchError
from weightsync.api.types import TransferReport, UpdateReport
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

from tests.conftest import RayNodes
from tests.ray_cluster import kill_actor
from tests.workloads import NUDGED, TpSink, TpSource, tp_part, tp_slice, tp_tensors

BUCKET = 256 * 1024
MODEL_BYTES = sum(tensor.nbytes for _, tensor in tp_tensors(0))
REPLICATED_BYTES = sum(tensor.nbytes for name, tensor in tp_tensors(0) if name.endswith("norm.weight"))


class Fleet:
    def __init__(self, ray_nodes: RayNodes) -> None:
        self.actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=TpSource, node_id=ray_nodes.head)
        self.replicas = [RayRolloutReplica.create(replica=index, sink_factory=TpSink, num_workers=2,
                                                  node_id=ray_nodes.head, parts=[tp_part(0), tp_part(1)])
                         for index in range(2)]

    def manager(self, backend: str = "shm", **config: Any) -> CheckpointEngineManager:
        return CheckpointEngineManager(backend=backend, actor_wg=self.actor_wg, replicas=self.replicas,
                                       config=SyncConfig(**{"bucket_bytes": BUCKET, **config}))

    def update(self, manager: CheckpointEngineManager, version: int) -> UpdateReport:
        ray.get(self.actor_wg.call("set_version", version))
        self.hashed()  # from here on: this update's
        ray.get(self.actor_wg.call("summed"))
        for replica in self.replicas:
            ray.get(replica.call("copied"))
        return asyncio.run(manager.update_weights(version=version))

    def hashed(self) -> list[int]:
        """Bytes each rollout worker's process hashed since the last call (replica by replica, worker by worker)."""
        return [ray.get(ref) for replica in self.replicas for ref in replica.call("hashed")]

    def check_holds(self, version: int) -> None:
        """Every worker holds exactly its slice of every tensor of ``version``."""
        expected = dict(tp_tensors(version))
        for replica in self.replicas:
            for rank, ref in enumerate(replica.call("held")):
                held = ray.get(ref)
                assert set(held) == set(expected)
                for name, tensor in held.items():
                    assert tensor.view(torch.int16).equal(tp_slice(name, expected[name], rank).view(torch.int16)), name


@pytest.fixture(scope="module")
def whole(ray_nodes: RayNodes) -> Iterator[RayRolloutReplica]:
    """A TP-2 replica whose workers declare no part (each receives the whole model): the negative controls'."""
    replica = RayRolloutReplica.create(replica=9, sink_factory=TpSink, num_workers=2, node_id=ray_nodes.head)
    try:
        yield replica
    finally:
        replica.shutdown()


@pytest.fixture(scope="module")
def fleet(ray_nodes: RayNodes) -> Iterator[Fleet]:
    made = Fleet(ray_nodes)
    try:
        yield made
    finally:
        made.actor_wg.shutdown()
        for replica in made.replicas:
            replica.shutdown()


def receivers(report: UpdateReport) -> list[TransferReport]:
    return [transfer for transfer in report.transfers if transfer.role == "rollout"]


def test_each_worker_reads_and_verifies_only_its_part(fleet: Fleet) -> None:
    manager = fleet.manager()
    for version in (1, 2):
        report = fleet.update(manager, version)
        assert report.ok, report.replicas
        fleet.check_holds(version)
        hashed = fleet.hashed()
        parts = sorted(transfer.part for transfer in receivers(report))
        assert parts == [0, 0, 1, 1]  # two distinct parts, each verified by one worker of each replica
        for transfer in receivers(report):
            assert transfer.part_bytes == (MODEL_BYTES - REPLICATED_BYTES) // 2 + REPLICATED_BYTES
        # Counted outside the engine: what each worker's process fed the hash library.
        assert all(nbytes <= 0.52 * MODEL_BYTES + REPLICATED_BYTES for nbytes in hashed), (hashed, MODEL_BYTES)
        assert all(nbytes >= 0.48 * MODEL_BYTES for nbytes in hashed), hashed


@pytest.mark.parametrize("mode", ["full", "delta"])
def test_copy_into_shards_copies_and_hashes_only_the_part(fleet: Fleet, mode: str) -> None:
    """Sinks that hold only their slices (shards of the slices' shapes) take updates with ``copy_into``: in a full
    update each worker's copy lands its part, and its process hashes no more than its part; a delta update (the
    second of a delta manager) lands in the shards too, its changes written straight into them: the worker's
    process copies nothing into a tensor with torch (``Tensor.copy_``, wrapped), where a shard refilled from a host
    copy of its tensor each delta update took about half the model that way."""
    for replica in fleet.replicas:
        ray.get(replica.call("set_loading", "shards"))
    try:
        manager = fleet.manager(delta=mode == "delta")
        for version in (NUDGED, NUDGED + 1):
            report = fleet.update(manager, version)
            assert report.ok, report.replicas
            fleet.check_holds(version)
            copied = [ray.get(ref) for replica in fleet.replicas for ref in replica.call("copied")]
            if version == NUDGED or mode == "full":
                assert all(nbytes <= 0.52 * MODEL_BYTES + REPLICATED_BYTES for nbytes in fleet.hashed())
            else:
                assert [outcome.received for outcome in report.replicas] == ["changes"] * 2
                assert copied == [0] * 4, copied
    finally:
        for replica in fleet.replicas:
            ray.get(replica.call("set_loading", "views"))


def test_copy_into_full_shape_destinations_writes_only_each_workers_slice(fleet: Fleet) -> None:
    """``copy_into`` destinations of the tensors' whole shapes that no compiled copy fills (matrices transposed in
    memory: every piece goes through its view), under a delta manager: a full update, two whose every bucket goes
    dense (random versions, nothing alike) and one of changes. Each worker's slice lands every time, and no element
    outside it is written. (Before, a piece's view was copied whole: outside the worker's regions a carrier's
    zeros, or a block's full-shape view, which holds the other block's bytes there, landed too.)"""
    for replica in fleet.replicas:
        ray.get(replica.call("set_loading", "full"))
    try:
        manager = fleet.manager(delta=True)
        received = []
        for version in (1, 2, NUDGED, NUDGED + 1):
            report = fleet.update(manager, version)
            assert report.ok, report.replicas
            received.append(report.replicas[0].received)
            fleet.check_holds(version)
            touched = [ray.get(ref) for replica in fleet.replicas for ref in replica.call("touched_outside")]
            assert touched == [[]] * 4, (version, touched)
        assert received == ["full", "full", "full", "changes"], received
    finally:
        for replica in fleet.replicas:
            ray.get(replica.call("set_loading", "views"))


def ring_holds(tensor: torch.Tensor) -> bool:
    """Whether some shared-memory segment of weightsync holds ``tensor``'s bytes, contiguous (read from
    ``/dev/shm``, outside the engines)."""
    pattern = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    for path in glob.glob("/dev/shm/weightsync-*"):
        try:
            with open(path, "rb") as segment:
                if pattern in segment.read():
                    return True
        except OSError:  # another test's segment, gone meanwhile
            continue
    return False


def windows(version: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two rows at a time of ``layers.2.down.weight`` of ``version`` (split along its columns: each worker holds one
    block of columns; in the ring's last buckets, which later ones have not overwritten): of the tensor, and of each
    block (the block's rows lie together only when the tensor travels block after block)."""
    tensor = dict(tp_tensors(version))["layers.2.down.weight"]
    rows = (10, 90, 170, 250)
    return ([tensor.narrow(0, row, 2) for row in rows],
            [block.narrow(0, row, 2) for block in tensor.chunk(2, 1) for row in rows])


def test_a_column_split_tensor_lies_block_after_block_in_the_ring(fleet: Fleet) -> None:
    """Every worker holds one block of columns of ``down.weight``: the ring holds each block's rows together (so
    each worker reads its block as one run), not the tensor's own rows (the negative control is the next test's)."""
    report = fleet.update(fleet.manager(), 30)
    assert report.ok, report.replicas
    fleet.check_holds(30)
    own, blocks = windows(30)
    assert all(map(ring_holds, blocks)) and not any(map(ring_holds, own))


def test_the_hash_counter_sees_a_whole_model_verification(fleet: Fleet, whole: RayRolloutReplica) -> None:
    """Negative control of the counter: workers that declare no part hash every byte of the update. And of the
    ring's layout: with workers of the whole model, ``o.weight`` lies in its own order."""
    manager = CheckpointEngineManager(backend="shm", actor_wg=fleet.actor_wg, replicas=[whole],
                                      config=SyncConfig(bucket_bytes=BUCKET))
    ray.get(fleet.actor_wg.call("set_version", 5))
    ray.get([ref for ref in whole.call("hashed")])
    report = asyncio.run(manager.update_weights(version=5))
    assert report.ok
    hashed = [ray.get(ref) for ref in whole.call("hashed")]
    assert all(nbytes >= MODEL_BYTES for nbytes in hashed), (hashed, MODEL_BYTES)
    assert all(transfer.part == -1 for transfer in receivers(report))
    own, blocks = windows(5)
    assert all(map(ring_holds, own)) and not any(map(ring_holds, blocks))


def test_a_worker_of_a_part_keeps_its_part_of_the_version_it_holds_alone(fleet: Fleet,
                                                                          whole: RayRolloutReplica) -> None:
    """With delta updates a worker that iterates views keeps a host copy of the version it holds, and a delta
    update's views lie in it. Read from each worker's page table (outside the engine): the copy of a worker that
    holds half of every split tensor takes about half the model (its half, and the norms both keep); a replica of
    workers of the whole model keeps all of it (the negative control). One bucket holds the model: a tensor split
    across buckets would be put together in a buffer of its own for its view."""
    manager = fleet.manager(delta=True, bucket_bytes=8 << 20)
    for version in (NUDGED + 40, NUDGED + 41):
        report = fleet.update(manager, version)
        assert report.ok, report.replicas
    assert [outcome.received for outcome in report.replicas] == ["changes"] * 2
    fleet.check_holds(NUDGED + 41)
    for replica in fleet.replicas:
        for resident, nbytes in ray.get(list(replica.call("views_resident"))):
            assert nbytes >= MODEL_BYTES and resident <= 0.52 * MODEL_BYTES + REPLICATED_BYTES, (resident, nbytes)
            assert resident >= 0.48 * MODEL_BYTES, (resident, nbytes)
    manager = CheckpointEngineManager(backend="shm", actor_wg=fleet.actor_wg, replicas=[whole],
                                      config=SyncConfig(bucket_bytes=8 << 20, delta=True))
    for version in (NUDGED + 42, NUDGED + 43):
        ray.get(fleet.actor_wg.call("set_version", version))
        assert asyncio.run(manager.update_weights(version=version)).ok
    for resident, nbytes in ray.get(list(whole.call("views_resident"))):
        assert resident >= MODEL_BYTES, (resident, nbytes)


def test_a_change_behind_the_engine_to_the_part_a_worker_keeps_fails_that_worker_alone(fleet: Fleet) -> None:
    """After a delta update each worker's views lie in the copy it keeps of its part. An element of ``embed.weight``
    that only worker 1 holds is changed there in both workers of replica 0: the next delta update fails worker 1
    alone (its part's digest differs), not worker 0 (the element is not in its part), tears replica 0 alone, and the
    next update repairs it (in full, as after any failed update)."""
    manager = fleet.manager(delta=True)
    for version in (NUDGED + 50, NUDGED + 51):
        assert fleet.update(manager, version).ok
    last = dict(tp_tensors(0))["embed.weight"].numel() - 1  # in the second half of its rows: worker 1's
    ray.get([ref for ref in fleet.replicas[0].call("scribble", "embed.weight", last)])
    with pytest.raises(DigestMismatchError, match="holds its part 1 of tensors") as raised:
        fleet.update(manager, NUDGED + 52)
    assert raised.value.details["receiver"] == 1 and "also:" not in str(raised.value)
    assert [state.state for state in manager.status()] == ["torn", "committed"]
    report = fleet.update(manager, NUDGED + 53)
    assert report.ok and [outcome.received for outcome in report.replicas] == ["full", "full"]
    fleet.check_holds(NUDGED + 53)


@pytest.mark.parametrize("mode", ["delta", "staged", "delta+staged"])
def test_parts_compose_with_delta_and_staged_updates(fleet: Fleet, mode: str) -> None:
    """Three updates of each mode, every worker holding its slice after each. A delta sender sums its kept copy's
    buckets for the model digest and for each part's digest at the first (full) update, and from then on keeps
    every sum up to date from the words that changed: the bytes its process sums (``native.delta_sum``, wrapped)
    are at least the model at the first update and none at the next two."""
    manager = fleet.manager(delta="delta" in mode, staged="staged" in mode)
    for version in (NUDGED + 10, NUDGED + 11, NUDGED + 12):  # a few elements apart: a delta sends changes
        report = fleet.update(manager, version)
        summed = ray.get(fleet.actor_wg.call("summed"))[0]
        assert report.ok, report.replicas
        fleet.check_holds(version)
        if "delta" not in mode or version == NUDGED + 10:  # the first update of a delta manager is full
            assert sorted(transfer.part for transfer in receivers(report)) == [0, 0, 1, 1], mode
            assert summed >= (MODEL_BYTES if "delta" in mode else 0), mode
        else:
            assert [outcome.received for outcome in report.replicas] == ["changes"] * 2, mode
            assert summed == 0, mode


def test_a_corrupted_byte_fails_only_the_worker_whose_part_holds_it(fleet: Fleet) -> None:
    """One byte of ``embed.weight`` that only worker 1 of each replica holds is changed after transit (on the shared
    ring, before any worker hashes it): worker 1 fails naming the tensor, worker 0 does not notice (its part is
    intact), the replicas stay torn and paused, and the next clean update repairs them."""
    manager = fleet.manager(backend_options={"transport_hook": "tests.workloads:FLIP_SECOND_HALF"})
    ray.get(fleet.actor_wg.call("set_version", 20))
    with pytest.raises(PartMismatchError) as raised:
        asyncio.run(manager.update_weights(version=20))
    assert raised.value.receiver in (1, 3) and raised.value.tensor == "embed.weight"  # worker 1 of a replica
    assert [state.state for state in manager.status()] == ["torn", "torn"]
    errors = [str(state.error) for state in manager.status()]
    assert all("PartMismatchError" in error and "embed.weight" in error for error in errors), errors
    report = fleet.update(fleet.manager(), 21)
    assert report.ok
    fleet.check_holds(21)


def test_a_tp_replica_that_dies_is_evicted_and_one_that_joins_takes_the_next_update_by_part(
        fleet: Fleet, ray_nodes: RayNodes) -> None:
    """Parts with an elastic fleet: a third TP-2 replica joins two that are serving delta updates. No peer holds a
    whole copy to catch it up from (a worker that holds a part keeps none), so the next update goes to everyone in
    full, each worker verifying its part. Then one of the newcomer's two workers is killed: the next update evicts
    that replica (its other worker alive), before any pause, and commits the other two by delta, every worker
    holding exactly its slice. (The fleet's two replicas are left as they were.)"""
    extra = RayRolloutReplica.create(replica=2, sink_factory=TpSink, num_workers=2, node_id=ray_nodes.head,
                                     parts=[tp_part(0), tp_part(1)])
    manager = fleet.manager(delta=True)
    try:
        for version in (NUDGED + 30, NUDGED + 31):
            assert fleet.update(manager, version).ok
        manager.add_replicas([extra])
        fleet.replicas.append(extra)  # check_holds and hashed cover it too
        report = fleet.update(manager, NUDGED + 32)
        assert report.ok and report.joined == (), report  # no peer: everyone takes it in full
        assert [outcome.received for outcome in report.replicas] == ["full"] * 3, report.replicas
        assert sorted(transfer.part for transfer in receivers(report)) == [0, 0, 0, 1, 1, 1]
        fleet.check_holds(NUDGED + 32)
        fleet.replicas.pop()
        kill_actor(lambda: extra.call("pid")[1], "the newcomer's worker 1")
        report = fleet.update(manager, NUDGED + 33)
        assert [(outcome.replica, outcome.state) for outcome in report.evicted] == [(2, "evicted")], report
        assert report.ok and [outcome.received for outcome in report.replicas] == ["changes"] * 2, report.replicas
        assert manager.replicas == tuple(fleet.replicas)
        fleet.check_holds(NUDGED + 33)
    finally:
        if fleet.replicas[-1] is extra:
            fleet.replicas.pop()
        extra.shutdown()
