"""The conformance kit must fail a transport that corrupts bytes — whichever side the corruption is on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch

from weightsync.api.protocols import copy_stream_into
from weightsync.api.testing import ConformanceFailure, EngineConformance, EngineHarness, WorkerFailed


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
