"""The progress bar of ``weightsync demo`` and ``weightsync bench``: one bar on stderr.

On a terminal the bar is redrawn in place and its line closed once it is full (or at ``finish``); anywhere else (a
pipe, a CI log) every redraw is a line of its own, so the log stays readable.
"""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]

BAR_WIDTH = 30


class Progress:
    """A bar of ``total`` steps; with ``clock`` it also shows the seconds since it was created."""

    def __init__(self, total: int, *, clock: bool = False) -> None:
        self.total = max(1, total)
        self.done = 0
        self.clock = clock
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._width = 0
        self._line_open = False

    def step(self, label: str, count: int = 1) -> None:
        """Count ``count`` more steps as done (0 changes only the label) and redraw."""
        self.show(min(self.total, self.done + count), label)

    def show(self, done: int, label: str) -> None:
        """Redraw with ``done`` of the steps done."""
        self.done = done
        filled = BAR_WIDTH * done // self.total
        line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{self.total} "
        if self.clock:
            line += f"{time.perf_counter() - self.started:5.0f}s  "
        line += label
        if self.tty:
            # Padded to the longest line so far: a shorter redraw must not leave the tail of a longer one behind.
            self._width = max(self._width, len(line))
            sys.stderr.write("\r" + line.ljust(self._width))
            self._line_open = done < self.total
            if not self._line_open:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        """Close the bar's line on a terminal if it is still open."""
        if self._line_open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._line_open = False
