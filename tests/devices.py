"""The emulated accelerator as the kit's device (``device`` fixture ``EMULATED``), in every worker process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EMULATED = "tests.devices:emulated_device"
"""The conformance kit's ``device`` for the emulated accelerator: ``resolve_device`` calls it in each worker."""

COPY_DELAY = 0.001
"""Seconds every emulated device copy waits before it runs: a missing wait then reads bytes not there yet."""


_delayed = False


def emulated_device() -> str:
    """Register the emulated accelerator in this process, with a delay in every device copy (set on the first call
    only: a test may have changed it since); its device type."""
    global _delayed
    from weightsync.emuaccel import install, set_copy_delay

    device = install()
    if not _delayed:
        set_copy_delay(COPY_DELAY)
        _delayed = True
    return device


NEGATIVE_CONTROL_DELAY = 0.05
"""Seconds per device copy in a negative control: far longer than any thread takes to reach the bytes it should have
waited for, even on a loaded machine, so a left-out wait reads old bytes every time."""


@contextlib.contextmanager
def slow_copies(seconds: float = NEGATIVE_CONTROL_DELAY) -> Iterator[None]:
    """Every emulated device copy queued inside the block waits ``seconds`` first (then back to ``COPY_DELAY``)."""
    from weightsync.emuaccel import set_copy_delay

    emulated_device()
    set_copy_delay(seconds)
    try:
        yield
    finally:
        set_copy_delay(COPY_DELAY)
