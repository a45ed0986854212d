"""A consumer that leaves a stream early, and the next ``receive_weights`` on the same engine.

The engine receives and drops the rest of the abandoned update in the background (the sender and the other
receivers finish). A ``receive_weights`` called meanwhile — the next update's, as a worker that retries at once
calls it — returns a stream that starts once that drain is done: it neither raises nor reads the old update's
buckets. Only one such stream may wait; one that is still being consumed keeps refusing a second. The drain does
not depend on the consumer's event loop running again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.reliability.test_bad_inputs import Pair, pair  # noqa: F401  (the fixture)
from weightsync.api.errors import ConcurrentUpdateError, DestinationError

TENSORS = 24  # 64 KiB each, one per 64 KiB bucket: far more buckets than ring slots


def weights(update: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(update)
    return [(f"w{i}", torch.randn(16 * 1024 - 64, generator=generator)) for i in range(TENSORS)]


def held(update: int, gate: threading.Event) -> Iterator[tuple[str, torch.Tensor]]:
    """The update's tensors, the last ones only once ``gate`` is set: the update stays in flight until then."""
    for index, item in enumerate(weights(update)):
        if index == TENSORS - 2:
            assert gate.wait(30.0), "the test never opened the gate"
        yield item


def send_in_thread(pair: Pair, items: object) -> tuple[threading.Thread, list[BaseException]]:
    failures: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(pair.sender.send_weights(items))  # type: ignore[arg-type]
        except BaseException as exc:  # reported to the test
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, failures


def test_receive_weights_after_a_consumer_left_early_waits_for_the_drain(pair: Pair) -> None:  # noqa: F811
    gate = threading.Event()
    first, first_failures = send_in_thread(pair, held(1, gate))

    async def scenario() -> dict[str, torch.Tensor]:
        stream = pair.receiver.receive_weights()
        name, _view = await stream.__anext__()
        assert name == "w0"
        with pytest.raises(ConcurrentUpdateError):  # still being consumed: a second stream is refused
            pair.receiver.receive_weights()
        await stream.aclose()  # the consumer leaves; the rest of update 1 is still to come (the gate is shut)

        successor = pair.receiver.receive_weights()  # does not raise: it waits for the drain
        with pytest.raises(ConcurrentUpdateError):  # but only one stream may wait
            pair.receiver.receive_weights()
        gate.set()
        await asyncio.to_thread(first.join, 30.0)
        assert not first.is_alive() and first_failures == []  # the sender finished update 1 unhindered

        second, second_failures = send_in_thread(pair, weights(2))
        received = {name: tensor.clone() async for name, tensor in successor}
        await asyncio.to_thread(second.join, 30.0)
        assert second_failures == []
        assert successor.report is not None and successor.report.tensors == TENSORS
        return received

    received = asyncio.run(scenario())
    expected = dict(weights(2))
    assert list(received) == list(expected)  # update 2's tensors, none of update 1's left-overs
    for name, tensor in expected.items():
        assert torch.equal(received[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_waiting_stream_closed_before_it_starts_gives_its_turn_back(pair: Pair) -> None:  # noqa: F811
    gate = threading.Event()
    first, _failures = send_in_thread(pair, held(3, gate))

    async def scenario() -> None:
        stream = pair.receiver.receive_weights()
        await stream.__anext__()
        await stream.aclose()
        waiting = pair.receiver.receive_weights()
        await waiting.aclose()  # never started: it held nothing, and gives up its place
        again = pair.receiver.receive_weights()
        gate.set()
        await asyncio.to_thread(first.join, 30.0)
        second, failures = send_in_thread(pair, weights(4))
        names = [name async for name, _tensor in again]
        await asyncio.to_thread(second.join, 30.0)
        assert failures == [] and names == [f"w{i}" for i in range(TENSORS)]

    asyncio.run(scenario())


def test_a_consumer_whose_loop_stops_after_it_failed_holds_nothing_up(pair: Pair) -> None:  # noqa: F811
    """A worker that drives its own event loop one call at a time (``run_until_complete``, as verl's workers do):
    its ``copy_into`` raises on the first bucket, and the loop does not run again while the rest of the update
    arrives. The engine's receive thread must acknowledge those buckets itself — in order, since the sender counts
    each acknowledgement — or the sender waits for them until its deadline, and the next update on the same
    connections finds them missing."""
    gate = threading.Event()
    first, first_failures = send_in_thread(pair, held(5, gate))
    loop = asyncio.new_event_loop()
    try:
        async def fail() -> None:
            stream = pair.receiver.receive_weights()
            with pytest.raises(DestinationError):
                await stream.copy_into({"w0": torch.zeros(3)})

        loop.run_until_complete(fail())
        gate.set()  # the last buckets are sent only now: they arrive while the loop stands still
        first.join(30.0)
        assert not first.is_alive() and first_failures == []  # the sender finished update 5 unhindered
        assert pair.update(weights(6)) == (None, None)  # the same epoch: every acknowledgement came, in order
        assert pair.delivered == [f"w{i}" for i in range(TENSORS)]
    finally:
        loop.close()
