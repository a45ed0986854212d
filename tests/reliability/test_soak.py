"""Soak: many consecutive updates with a fault every 20 — nothing grows, nothing leaks, every good update exact.

CI runs the short form (40 updates, 2 faults); `WEIGHTSYNC_SOAK_UPDATES=200` runs the full one.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections import Counter
from dataclasses import dataclass

import psutil
import pytest
import ray

from tests.conftest import RayNodes
from tests.workloads import ModelSource, RecordingSink
from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.errors import WeightsyncError
from weightsync.core.control.manager import CheckpointEngineManager
from weightsync.ray import RayActorWorkerGroup, RayRolloutReplica

UPDATES = int(os.environ.get("WEIGHTSYNC_SOAK_UPDATES", "40"))


def fd_targets(pid: int) -> list[str]:
    """What each open descriptor points at (shown when a count differs)."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return sorted(targets)


@dataclass(frozen=True)
class Usage:
    rss: int
    fds: int
    threads: int


def usage(pid: int) -> Usage:
    process = psutil.Process(pid)
    return Usage(rss=process.memory_info().rss, fds=process.num_fds(), threads=process.num_threads())


def shm_segments(pids: list[int] | None = None) -> int:
    """Ring segments in /dev/shm: all of ours, or those created by ``pids`` (a segment's name carries its creator's
    pid), so orphans that an earlier test's killed process left, and their sweeping, do not count."""
    prefixes = tuple(f"weightsync-{pid}-" for pid in pids) if pids is not None else ("weightsync-",)
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith(prefixes))


DEFAULT_POOL = re.compile(r"asyncio_(\d+)")
"""Workers of asyncio's default executor (``asyncio.to_thread``): a bounded pool that may add a worker when two
calls meet under load, up to its bound. Every other thread name must match exactly."""


def grown_beyond_bounds(before: list[str], after: list[str]) -> list[str]:
    """Threads in ``after`` that ``before`` lacked, other than default-executor workers within the pool's bound."""
    bound = min(32, (os.cpu_count() or 1) + 4)
    extra = Counter(after) - Counter(before)
    return sorted(name for name in extra.elements()
                  if not ((match := DEFAULT_POOL.fullmatch(name)) and int(match.group(1)) < bound))


def thread_names(actor_wg: RayActorWorkerGroup, replicas: list[RayRolloutReplica]) -> list[list[str]]:
    refs = actor_wg.call("thread_names") + [ref for replica in replicas for ref in replica.call("thread_names")]
    return [list(names) for names in ray.get(refs)]


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_soak(ray_nodes: RayNodes, backend: str) -> None:
    actor_wg = RayActorWorkerGroup.create(world_size=1, source_factory=ModelSource, node_id=ray_nodes.head)
    replicas = [RayRolloutReplica.create(replica=i, sink_factory=RecordingSink, node_id=ray_nodes.head)
                for i in range(2)]
    try:
        manager = CheckpointEngineManager(
            backend=backend, actor_wg=actor_wg, replicas=replicas,
            config=SyncConfig(bucket_bytes=256 * 1024, timeouts=StepTimeouts(transfer=20)),
        )
        pids = [int(ray.get(actor_wg.call("pid")[0]))] + [int(ray.get(r.call("pid")[0])) for r in replicas]
        baseline: list[Usage] = []
        faults = exact = 0
        for update in range(1, UPDATES + 1):
            if update % 20 == 5:
                ray.get(actor_wg.call("set_mode", "raise_midway"))
                with pytest.raises(WeightsyncError):
                    asyncio.run(manager.update_weights())
                ray.get(actor_wg.call("set_mode", "normal"))
                faults += 1
            else:
                expected = ray.get(actor_wg.call("set_version", update))[0]
                report = asyncio.run(manager.update_weights())
                digests = [ray.get(r.call("digest")[0]) for r in replicas]
                assert report.ok and digests == [expected, expected], f"update {update}"
                exact += 1
            if update == 10:  # after warm-up and a first fault-and-recovery cycle
                baseline = [usage(pid) for pid in pids]
                baseline_fds = [fd_targets(pid) for pid in pids]
                names_before = thread_names(actor_wg, replicas)
                segments_baseline = shm_segments(pids)
        final = [usage(pid) for pid in pids]
        for role, before, after in zip(["sender", "receiver0", "receiver1"], baseline, final):
            print(f"soak {backend} {UPDATES} updates, {faults} faults, {role}: rss {before.rss / 2**20:.1f} -> "
                  f"{after.rss / 2**20:.1f} MiB ({(after.rss / before.rss - 1) * 100:+.2f}%), fds {before.fds} -> "
                  f"{after.fds}, threads {before.threads} -> {after.threads}")
        # Every Python thread (ours, asyncio's, Ray's) was there at the baseline, bar a bounded pool's growth.
        names_after = thread_names(actor_wg, replicas)
        for before_names, after_names in zip(names_before, names_after):
            assert grown_beyond_bounds(before_names, after_names) == [], (before_names, after_names)
        assert faults >= 2 and exact == UPDATES - faults
        for pid, before, after in zip(pids, baseline, final):
            assert after.rss < before.rss * 1.05, (pid, before, after)
            # Every fault starts a new membership epoch with new connections: a leak of ours would add a descriptor
            # per epoch (10 in the full soak). Ray's core worker may open one more connection lazily, hence 1.
            gained = Counter(fd_targets(pid)) - Counter(baseline_fds[pids.index(pid)])
            assert after.fds <= before.fds + 1, (pid, before, after, dict(gained))
            # OS threads include Ray's and gRPC's native pools, which may add a worker on demand; ours are above.
            assert after.threads <= before.threads + 2, (pid, before, after)
        assert shm_segments(pids) == segments_baseline
    finally:
        actor_wg.shutdown()
        for replica in replicas:
            replica.shutdown()
    # Every segment the engines created went away with them (the actors' close() or process exit).
    assert shm_segments(pids) == 0


def test_thread_growth_check_fails_on_a_new_thread_or_an_unbounded_pool() -> None:
    # Negative control of the soak's thread check: a thread of a new kind, or a pool past its bound, is reported.
    before = ["MainThread", "asyncio_0", "ws-shm-xfer_0"]
    assert grown_beyond_bounds(before, [*before, "asyncio_1"]) == []
    assert grown_beyond_bounds(before, [*before, "ws-shm-xfer_0"]) == ["ws-shm-xfer_0"]
    assert grown_beyond_bounds(before, [*before, "asyncio_99"]) == ["asyncio_99"]
