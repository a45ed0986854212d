"""The conformance kit must fail a transport that corrupts bytes — whichever side the corruption is on — or that
breaks the rules between the pipeline and a transport."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch

from tests.plugins import backends_on_path
from weightsync.api.protocols import copy_stream_into
from weightsync.api.testing import ConformanceFailure, EngineConformance, EngineHarness, WorkerFailed, checked_options
from weightsync.core.transports.rules import CheckedReceiver, CheckedSender, TransportRuleError
from weightsync.core.transports.seam import ReceivedBucket
from weightsync.core.wire.codec import UpdateHeaders


MODES = ["iterate", "copy_into"]


def _run(hook: str, mode: str) -> None:
    harness = EngineHarness("shm", receivers=2, options={"transport_hook": hook}, timeout=60)
    harness.start()
    try:
        harness.setup()
        harness.update("mixed", mode=mode)
    finally:
        harness.close()


@pytest.mark.parametrize("mode", MODES)
def test_kit_fails_a_sender_that_corrupts_before_hashing(mode: str) -> None:
    # The digest cannot see this corruption (it is hashed as sent): only the kit's byte comparison can.
    with pytest.raises(ConformanceFailure, match="bytes differ"):
        _run("tests.workloads:FLIP_AFTER_PACK", mode)


@pytest.mark.parametrize("mode", MODES)
def test_kit_fails_a_transport_that_corrupts_in_transit(mode: str) -> None:
    # With copy_into the receiver hashes while it copies: the flipped byte is still seen.
    with pytest.raises(WorkerFailed) as caught:
        _run("tests.workloads:FLIP_AFTER_RECEIVE", mode)
    assert caught.value.error_type == "DigestMismatchError"


@pytest.fixture(scope="module")
def rulebreakers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The rule-breaking backends, registered here and in the kit's workers."""
    with backends_on_path(tmp_path_factory.mktemp("rulebreakers"), {
        "test-early-free-gloo": "tests.api.rulebreakers:EARLY_FREE_GLOO",
        "test-early-ack-shm": "tests.api.rulebreakers:EARLY_ACK_SHM",
    }):
        yield


@pytest.mark.parametrize("backend", ["test-early-free-gloo", "test-early-ack-shm"])
def test_kit_fails_a_transport_that_frees_a_bucket_before_its_release(rulebreakers: None, backend: str) -> None:
    # Two slots, and each release waits 50 ms before it compares: the sender (or the receive thread) comes back to a
    # slot while the consumer still holds it. A sender whose receivers failed gives up after 5 s.
    options = checked_options(backend, {"slots": 2, "check_transport": 0.05, "timeout": 5})
    harness = EngineHarness(backend, receivers=2, options=options, timeout=60)
    harness.start()
    try:
        harness.setup()
        with pytest.raises(WorkerFailed) as caught:
            for version in range(1, 4):
                harness.update("three_buckets", version)
    finally:
        harness.close()
    # The receivers find it (the sender may only see them go: a TransferError); gloo's receiver gives a token still
    # held again (rule 2) and overwrites its bytes (rule 3), either first; shm's sender overwrites them (rule 3).
    rules = [each.text for each in (caught.value, *caught.value.others) if each.error_type == "TransportRuleError"]
    assert rules, [str(each) for each in (caught.value, *caught.value.others)]
    assert all("changed before its release" in text or "a bucket still held carries" in text for text in rules)


def test_an_engine_of_weightsync_is_checked_by_the_kit() -> None:
    assert checked_options("shm", {"slots": 3}) == {"check_transport": True, "slots": 3}


def test_the_checks_fail_a_pipeline_that_breaks_the_rules() -> None:
    """The pipeline's side, on a transport of its own: a release out of order or twice, a slot reused unwaited."""

    class Ring:
        capacity = slots = 2

        def __init__(self) -> None:
            self.tokens = iter(range(1, 10))

        def receive(self, deadline: float) -> ReceivedBucket:
            header = UpdateHeaders(epoch="e", version=1, sender=0).bucket(index=0, slot=0, nbytes=0, table=b"\x90")
            return ReceivedBucket(header=header, payload=torch.zeros(1, dtype=torch.uint8), token=next(self.tokens))

        def release(self, token: int) -> None:
            pass

        def buffer(self, slot: int) -> torch.Tensor:
            return torch.zeros(2, dtype=torch.uint8)

        def wait_slot(self, slot: int, deadline: float) -> None:
            pass

        def publish(self, slot: int, nbytes: int, header: bytes, deadline: float) -> None:
            pass

        def close(self) -> None:
            pass

    receiver = CheckedReceiver(Ring(), hold=0)
    first, second = receiver.receive(0).token, receiver.receive(0).token
    with pytest.raises(TransportRuleError, match="before 1"):
        receiver.release(second)
    receiver.release(first)
    with pytest.raises(TransportRuleError, match="does not hold"):
        receiver.release(first)
    receiver.release(second)  # positive control: in order, once each
    sender = CheckedSender(Ring())
    sender.publish(0, 1, b"", 0)
    with pytest.raises(TransportRuleError, match="without wait_slot"):
        sender.publish(0, 1, b"", 0)
    sender.wait_slot(0, 0)
    sender.publish(0, 1, b"", 0)  # positive control


def test_kit_fails_an_engine_that_sends_every_delta_update_full() -> None:
    # The sender keeps no version while a test hook watches its packed buckets: the bytes arrive intact, all of them.
    harness = EngineHarness("shm", receivers=2, options={"transport_hook": "tests.workloads:WATCH_AFTER_PACK"})
    with pytest.raises(AssertionError, match="update 1 went full"):
        EngineConformance().test_delta_updates(harness)  # it starts a harness of its own, alike


def test_kit_fails_an_engine_that_writes_a_mismatched_destination() -> None:
    # Negative control of the wrong_shape mode: a stream that copies without checking shapes is caught.
    from weightsync.api.testing.harness import _expect_destination_error

    class Careless(_Stream):
        async def copy_into(self, destinations: dict[str, torch.Tensor],
                            fallback: Callable[[str, torch.Tensor], object] | None = None) -> int:
            for name, tensor in self._items:
                destinations[name].view(-1)[: tensor.numel()].copy_(tensor.view(-1))
            return 0

    weights = {"w": torch.ones(4, 3), "b": torch.ones(3)}

    def zeros() -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(tensor) for name, tensor in weights.items()}

    result = asyncio.run(_expect_destination_error(Careless(list(weights.items())), weights, zeros()))
    assert any("accepted" in problem for problem in result["problems"])
    assert any("was written" in problem for problem in result["problems"])
    # Positive control: the generic implementation checks shapes before writing.
    honest = asyncio.run(_expect_destination_error(_Stream(list(weights.items())), weights, zeros()))
    assert honest["problems"] == []


class _Stream:
    """A plain stream of ``items`` whose ``copy_into`` is the generic one (shapes checked before writing)."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self._items = iter(items)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        try:
            return next(self._items)
        except StopIteration:
            raise StopAsyncIteration from None

    async def copy_into(self, destinations: dict[str, torch.Tensor],
                        fallback: Callable[[str, torch.Tensor], object] | None = None) -> int:
        return await copy_stream_into(self, destinations, fallback=fallback)
