"""``weightsync bench --staged``: receivers that serve while they are not paused, and the staged update's two phases.

With ``--staged`` every receiver of every entry serves: a thread runs one forward pass of a fixed small MLP (two
matrices, about 8 MiB of bf16, views of the model the receiver holds) every ``PERIOD`` seconds, one thread, and
stops only while the receiver is paused. A pause takes effect at the end of the next pass (as an inference engine
pauses between two steps), a resume starts a pass at once. Pause figures are measured here, inside the receivers:
from the end of the last forward pass before the pause to the end of the first one after the resume.

The manager pauses and resumes a receiver through its replica's hooks (``weightsync.cli.bench.group``): an unstaged
entry every receiver around the transfer, a staged entry (``B+staged``, the manager's staged flow) each receiver
only for its swap, while its host's stagers stage and every receiver serves.
"""

from __future__ import annotations

import bisect
import threading
import time
import torch

__all__ = ["PERIOD", "Server"]

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
