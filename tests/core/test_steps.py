"""``steps.unreachable``: after a timeout, a host none of whose workers answers a ping is named; a host that
answers through any worker is not (its pending worker was waiting, or is stuck on a host that is up)."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Awaitable
from typing import Any

import pytest
from weightsync.api.errors import ConfigError, HostUnreachableError, StepTimeoutError, WeightsyncError
from weightsync.core.control import steps

WHERE = {"actor rank 0": "h1 (198.18.0.2)", "replica0/worker0": "h2 (198.18.0.3)",
         "replica0/worker1": "h2 (198.18.0.3)", "replica1/worker0": "h3 (198.18.0.4)"}
TIMED_OUT = StepTimeoutError("step 'transfer' did not finish within 6s", step="transfer", workers=list(WHERE))


async def answers() -> dict[str, Any]:
    return {"hostname": "somewhere"}


async def silent() -> None:
    await asyncio.sleep(60)


async def refuses() -> None:
    raise ConfigError("unknown checkpoint-engine method 'ping'")


def probe(pings: dict[str, Awaitable[Any]]) -> tuple[HostUnreachableError | None, float]:
    started = time.perf_counter()
    error = asyncio.run(steps.unreachable(TIMED_OUT, 6.0, list(pings.items()), WHERE))
    return error, time.perf_counter() - started


def test_a_host_whose_only_worker_is_silent_is_named() -> None:
    error, seconds = probe({"actor rank 0": answers(), "replica0/worker0": answers(),
                            "replica0/worker1": answers(), "replica1/worker0": silent()})
    assert isinstance(error, HostUnreachableError) and isinstance(error, StepTimeoutError)
    assert error.hosts == ["h3 (198.18.0.4)"] and error.unreachable == ["replica1/worker0"]
    assert error.step == "transfer" and list(error.workers) == list(WHERE)
    assert "host h3 (198.18.0.4) does not answer" in str(error) and "6s" in str(error)
    assert seconds < steps.PROBE_TIMEOUT_S + 1.0  # the probe is bounded, not the silent worker's 60 s
    copy = pickle.loads(pickle.dumps(error))  # Ray carries it back by pickling
    assert type(copy) is HostUnreachableError and copy.hosts == error.hosts


def test_every_silent_host_is_named_once() -> None:
    error, _ = probe({"actor rank 0": silent(), "replica0/worker0": silent(), "replica0/worker1": silent(),
                      "replica1/worker0": answers()})
    assert error is not None
    assert error.hosts == ["h1 (198.18.0.2)", "h2 (198.18.0.3)"]
    assert error.unreachable == ["actor rank 0", "replica0/worker0", "replica0/worker1"]


def test_a_host_that_answers_through_another_worker_is_not_named() -> None:
    # replica0/worker0 is stuck, but its host answers through replica0/worker1: the host is up.
    error, _ = probe({"actor rank 0": answers(), "replica0/worker0": silent(), "replica0/worker1": answers(),
                      "replica1/worker0": answers()})
    assert error is None


def test_an_error_answer_counts_as_an_answer() -> None:
    # An adapter that has no ping answers with an error: its host is reachable.
    error, _ = probe({"actor rank 0": refuses(), "replica0/worker0": answers(), "replica0/worker1": answers(),
                      "replica1/worker0": refuses()})
    assert error is None


def test_a_worker_of_unknown_host_is_named_by_itself() -> None:
    error = asyncio.run(steps.unreachable(TIMED_OUT, 6.0, [("replica9/worker0", silent())], {}))
    assert error is not None and error.hosts == ["of replica9/worker0"]


@pytest.mark.parametrize("outcomes, expected", [
    ([TIMED_OUT, "report", TIMED_OUT], TIMED_OUT),
    (["report", ConfigError("bad"), "report"], None),
])
def test_timeout_of_finds_the_gather_s_own_timeout(outcomes: list[Any], expected: Any) -> None:
    labels = ["actor rank 0", "replica0/worker0", "replica1/worker0"]
    assert steps.timeout_of(labels, outcomes) is expected


@pytest.mark.parametrize("fail_fast", [True, False])
def test_a_setup_step_with_a_failed_worker_ends_without_waiting_for_its_timeout(fail_fast: bool) -> None:
    """With ``fail_fast`` (setup's steps) a worker's failure is raised a moment after it, the worker left waiting
    for it (a sender whose receiver failed) cancelled; without (the control), the step waits for its timeout."""
    async def step() -> tuple[BaseException, float]:
        started = time.perf_counter()
        with pytest.raises(WeightsyncError) as raised:
            await steps.gather("init_process_group", 4.0, [("actor rank 0", silent()), ("replica1/worker0", refuses())],
                               fail_fast=fail_fast)
        return raised.value, time.perf_counter() - started

    error, seconds = asyncio.run(step())
    if fail_fast:
        assert isinstance(error, ConfigError) and seconds < steps.CANCEL_WAIT_S + 1.5, (error, seconds)
        assert "raised by replica1/worker0 during init_process_group" in str(error.__notes__)
    else:
        assert isinstance(error, StepTimeoutError) and seconds >= 4.0
