"""Optional Chrome-trace spans of the pipeline's stages (plan, pack, transfer, receive, unpack), per bucket."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Tracer"]


class Tracer:
    """Appends spans to ``events`` once ``enable()`` was called; costs one attribute test per span otherwise."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.events: list[dict[str, Any]] | None = None

    def enable(self) -> list[dict[str, Any]]:
        """Record spans (``ph: X``, microseconds of CLOCK_MONOTONIC, shared by every process on the host)."""
        self.events = []
        return self.events

    def span(self, stage: str, index: int, start: float, end: float) -> None:
        if self.events is not None:
            self.events.append({
                "name": f"{stage} {index}", "cat": stage, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                "pid": self.process, "tid": threading.current_thread().name,
            })
