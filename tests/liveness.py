"""The event-loop liveness check shared by the manager tests (Ray adapter and verl adapter)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def measure_liveness(update: Callable[[], Awaitable[Any]]) -> tuple[int, float, float]:
    """Run ``update`` while a ticker sleeps 10 ms at a time; return ticks, worst lateness and the update's seconds."""
    ticks = 0
    worst = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks, worst
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            worst = max(worst, time.perf_counter() - before - 0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    try:
        await update()
    finally:
        seconds = time.perf_counter() - started
        stop.set()
        await task
    return ticks, worst, seconds
