"""``weightsync bench --staged``: receivers that serve while they are not paused, and the staged update's two phases.

With ``--staged`` every receiver of every entry serves: a thread runs one forward pass of a fixed small MLP (two
matrices, about 8 MiB of bf16, views of the model the receiver holds) every ``PERIOD`` seconds, one thread, and
stops only while the receiver is paused. A pause takes effect at the end of the next pass (as an inference engine
pauses between two steps), a resume starts a pass at once. Pause figures are measured here, inside the receivers:
from the end of the last forward pass before the pause to the end of the first one after the resume.

A staged entry (``B+staged``) runs an update as the manager does (``weightsync.core.control.staged``): the sender
sends and one receiver per host (its first) stages into the host's staging area while every receiver serves; then
each receiver swaps (pause, apply from its host's area into its model, resume).
"""

from __future__ import annotations

import asyncio
import bisect
import threading
import time
from typing import Any

import torch

from weightsync.api.types import StagedUpdate
from weightsync.core.transports.stagearea import StageArea

__all__ = ["PERIOD", "Server", "stage", "swap"]

PERIOD = 0.02
"""Seconds between the starts of two forward passes of a serving receiver."""
MLP_ELEMENTS = 2 << 20
"""bf16 elements of each of the MLP's two matrices (4 MiB each)."""
WIDTH = 1024
FIRST_PASS_WAIT_S = 2.0


def _mlp(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two matrices viewed in the largest tensor the receiver holds: A (rows x 1024) and B (1024 x rows), rows
    2048 where the tensor has the 4 Mi elements, fewer where it is smaller."""
    largest = max(tensors, key=lambda tensor: tensor.numel()).view(-1)
    rows = max(1, min(MLP_ELEMENTS, largest.numel() // 2) // WIDTH)
    half = rows * WIDTH
    return largest[:half].view(rows, WIDTH), largest[half:2 * half].view(WIDTH, rows)


class Server:
    """A receiver's serving loop (a daemon thread), paused and resumed by the driver's commands."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._a, self._b = _mlp(tensors)
        self._x = torch.ones(WIDTH, dtype=self._a.dtype)
        self._lock = threading.Lock()
        self._paused = False
        self.done: list[float] = []
        """``time.monotonic()`` at the end of every forward pass (comparable across this machine's processes)."""
        self.failed = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set by ``resume`` and ``close``: the loop starts its next pass now, as a server with requests queued
        during the pause would."""
        self._thread = threading.Thread(target=self._loop, name="bench-serving", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                if not self._paused:
                    try:
                        hidden = torch.relu(self._a @ self._x)
                        (self._b @ hidden).sum().item()
                        self.done.append(time.monotonic())
                    except Exception:  # noqa: BLE001 - a failed request, counted
                        self.failed += 1
            next_at += PERIOD
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind: start again from now rather than run passes back to back
                next_at, delay = time.monotonic(), 0.0
            if self._wake.wait(delay):
                self._wake.clear()
                next_at = time.monotonic()

    def pause(self) -> float:
        """Stop serving at the end of the next pass, as an engine pauses between two of its steps (a request that
        arrives meanwhile is still served); the end of that pass, the last before the pause."""
        mark = len(self.done)
        deadline = time.monotonic() + FIRST_PASS_WAIT_S
        while len(self.done) <= mark and time.monotonic() < deadline:
            time.sleep(0.0005)
        with self._lock:
            self._paused = True
            return self.done[-1] if self.done else time.monotonic()

    def resume(self) -> int:
        """Serve again; the number of passes so far (``first_after`` takes it)."""
        with self._lock:
            self._paused = False
            self._wake.set()
            return len(self.done)

    def first_after(self, mark: int) -> float:
        """The end of pass ``mark`` (the first after a resume), waiting for it a while."""
        deadline = time.monotonic() + FIRST_PASS_WAIT_S
        while len(self.done) <= mark and time.monotonic() < deadline:
            time.sleep(PERIOD / 4)
        return self.done[mark] if len(self.done) > mark else time.monotonic()

    def count(self, start: float, end: float) -> int:
        """Passes that ended in [start, end] (monotonic seconds)."""
        return bisect.bisect_right(self.done, end) - bisect.bisect_left(self.done, start)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5.0)


def stage(engine: Any, area: StageArea, *, version: int) -> dict[str, Any]:
    """The stage phase on a host's stager."""
    staged: StagedUpdate = asyncio.run(engine.stage_weights(area, version=version))
    engine.finalize()
    return staged.to_dict()  # its report too: a host's stripes, staged by several stagers, are joined by it


def swap(engine: Any, server: Server | None, destinations: dict[str, torch.Tensor], staged: dict[str, Any]
         ) -> dict[str, float]:
    """The swap on one receiver: pause (its serving), apply its host's staged update into ``destinations``,
    resume. Monotonic times: the last pass before the pause, the apply's seconds, and the pass count at resume."""
    last = server.pause() if server is not None else time.monotonic()
    started = time.perf_counter()

    async def apply() -> None:
        await engine.receive_staged(StagedUpdate.from_dict(staged)).copy_into(destinations)

    asyncio.run(apply())
    engine.finalize()
    applied = time.perf_counter() - started
    mark = server.resume() if server is not None else 0
    return {"last_before": last, "apply_seconds": applied, "mark": mark}
