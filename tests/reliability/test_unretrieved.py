"""Negative control of the reliability tests' checker (``conftest.NeverRetrieved``): a task that raised and that
nobody awaited is reported, so its silence after every fault test means something."""

from __future__ import annotations

import asyncio

from tests.reliability.conftest import NeverRetrieved


def test_the_checker_catches_a_forgotten_task() -> None:
    async def fails() -> None:
        raise RuntimeError("nobody reads this")

    async def forget() -> None:
        asyncio.ensure_future(fails())
        await asyncio.sleep(0.01)

    with NeverRetrieved() as checker:
        asyncio.run(forget())
    assert checker.found and "never retrieved" in checker.found[0], checker.found
