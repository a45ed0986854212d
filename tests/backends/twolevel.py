"""The chain's two-level layout under the conformance kit, for nixl and mooncake: a mixin that spreads the workers
over three pretend hosts and checks from outside the engine which process reads which ring.

Pretend hosts: entry 0 is the sender's host (it and rollout rank 0), then rollout ranks 1 and 2 (rank 1 leads),
then rank 3 (alone: a leader). Readers that share a host with their upstream must map its ring (a ``/dev/shm``
segment named after its creator's pid) and own none; leaders own one and map no one else's: read from
``/dev/shm`` and ``/proc/<pid>/maps``, not from the engine.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from weightsync.api.testing import EngineHarness

HOSTS = [0, 0, 1, 1, 2]
LEADER_OF = {0: 0, 1: 0, 2: 2, 3: 2, 4: 4}  # position -> the position whose ring it holds or maps
SEGMENT = re.compile(r"/dev/shm/(weightsync-(\d+)-[0-9a-f]{12}-\d+)")


def rings_mapped(pid: int) -> dict[int, str]:
    """The weightsync segments ``pid`` maps, by the pid of the process that created each."""
    with open(f"/proc/{pid}/maps") as maps:
        found = {match.group(1): int(match.group(2)) for match in SEGMENT.finditer(maps.read())}
    return {creator: name for name, creator in found.items()}


def check_in_place(pids: list[int], leader_of: dict[int, int]) -> None:
    """Every position maps exactly its leader's ring (its own, for a leader); leaders' rings exist in /dev/shm."""
    for position, pid in enumerate(pids):
        leader_pid = pids[leader_of[position]]
        assert set(rings_mapped(pid)) == {leader_pid}, (position, rings_mapped(pid))
    owners = {int(m.group(2)) for m in map(SEGMENT.match, (f"/dev/shm/{n}" for n in os.listdir("/dev/shm"))) if m}
    assert {pids[p] for p in set(leader_of.values())} <= owners
    assert not owners & {pids[p] for p in leader_of if leader_of[p] != p}  # in-place readers own no ring


class TwoLevelHosts:
    """Put it before a backend's conformance class: the same cases in the two-level layout on three hosts."""

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return len(HOSTS) - 1

    @pytest.fixture(scope="class")
    @classmethod
    def hosts(cls) -> list[int] | None:
        return HOSTS

    @pytest.fixture(scope="class")
    @classmethod
    def engine_options(cls) -> dict[str, Any]:
        # Pieces far smaller than a bucket: rank 1 relays every bucket to rank 3 in 16 pieces as they land.
        return {"layout": "two_level", "relay_piece_bytes": 65536}

    def test_the_workers_of_a_host_read_its_leader_s_ring_in_place(self, harness: EngineHarness) -> None:
        harness.update("three_buckets")
        check_in_place(harness.pids, LEADER_OF)
