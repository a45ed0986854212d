"""The emulated accelerator as the kit's device (``device`` fixture ``EMULATED``), in every worker process."""

from __future__ import annotations

EMULATED = "tests.devices:emulated_device"
"""The conformance kit's ``device`` for the emulated accelerator: ``resolve_device`` calls it in each worker."""

COPY_DELAY = 0.001
"""Seconds every emulated device copy waits before it runs: a missing wait then reads bytes not there yet."""


def emulated_device() -> str:
    """Register the emulated accelerator in this process, with a delay in every device copy; its device type."""
    from weightsync.emuaccel import install, set_copy_delay

    device = install()
    set_copy_delay(COPY_DELAY)
    return device
