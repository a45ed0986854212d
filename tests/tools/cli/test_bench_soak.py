"""``weightsync bench --soak``, short (CI's version of the closing note's 40 updates): 10 delta updates on the
emulated testbed, seed 1, which draws each event once: a replica added, one killed between updates and one killed
mid-update. Every update is checked by the soak's driver from outside the manager (each worker's bytes hashed in
its own process, each replica's own serving flag); here: that it passed, that the events struck, that each kill
was evicted by the update it struck, that the added replica caught up from a peer, that every update after the
first was a delta (but for a second transfer, full), and that nothing was left behind. With
eviction off (the negative control) the same run fails: the kills fail their updates."""

from __future__ import annotations

import pytest

from tests.tools.testbed.support import skip_unless_testbed
from weightsync.cli.bench.soak import soak


@pytest.fixture(autouse=True)
def testbed_here() -> None:
    skip_unless_testbed()


def test_a_soak_with_replicas_killed_and_added_passes_and_leaves_nothing_behind() -> None:
    lines: list[str] = []
    result = soak(10, 1, say=lines.append)
    assert result.ok, (result.problems, lines)
    events = {line["event"]: line for line in result.updates if line["event"]}
    assert sorted(events) == ["add", "kill-between", "kill-mid"], lines
    for kill in ("kill-between", "kill-mid"):
        assert len(events[kill]["evicted"]) == 1 and "WorkerDiedError" in events[kill]["evicted"][0], events[kill]
    assert events["add"]["replicas"] == 3 and events["add"]["joined"] == 1  # caught up from a peer first
    # Every update after the first a delta, but where a kill tore survivors: their second transfer is full.
    assert all(line["received"] == ["changes"] for line in result.updates[1:] if not line["retried"]), lines
    assert len(lines) == 10


def test_with_eviction_off_the_same_soak_fails() -> None:
    result = soak(4, 1, say=lambda line: None, max_evicted=0)
    assert not result.ok and any("raised" in problem for problem in result.problems), result.problems
