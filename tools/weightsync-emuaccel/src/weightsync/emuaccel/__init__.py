"""An emulated accelerator for tests: torch's PrivateUse1 backend, named ``"emu"``.

Why it exists: weightsync's device paths (staging a tensor between its device and a transport's host buffers,
stream-ordered copies, events between streams) must run in CI, which has no GPU. Host memory pretending to be a
device would let the two mistakes that matter pass by luck: reading device memory from the host, and reading a
buffer before the asynchronous copy into it has finished. The emulator makes both fail:

* its memory is not host-addressable: a tensor's ``data_ptr()`` points into a ``PROT_NONE`` mapping, so a host
  read through it faults, and ``.numpy()`` refuses it as for any device tensor; only the stream workers reach
  the pages, through a second mapping of the same memory;
* its streams are asynchronous: each stream (the default one included) is a queue drained by a worker thread of
  its own, a non-blocking copy between the device and pinned host memory returns before it has run, and
  ``set_copy_delay`` (or ``WEIGHTSYNC_EMU_COPY_DELAY_MS``) slows every copy down so that a missing wait shows as
  wrong bytes rather than passing by luck.

Usage, in every process that touches the device (a test, a spawned worker, each Ray actor)::

    from weightsync.emuaccel import install
    device_type = install()                    # "emu"; the first call in a process loads (or builds) the library
    x = torch.randn(4).to(device_type)
    torch.accelerator.current_accelerator()    # device(type='emu')

The C++ library is compiled on the first ``install()`` on a machine (about a minute) and cached per user, torch
version and Python (see ``_build``). Environment variables, read by the first ``install()`` in a process:
``WEIGHTSYNC_EMU_COPY_DELAY_MS`` (float, default 0), ``WEIGHTSYNC_EMU_DEVICE_COUNT`` (default 1),
``WEIGHTSYNC_EMU_MEMORY_BYTES`` (capacity per device, default 8 GiB), ``WEIGHTSYNC_EMU_CACHE_DIR`` (where the
library is built), ``WEIGHTSYNC_EMU_BUILD_VERBOSE`` (show the compiler's output).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from importlib.metadata import version as _version
from pathlib import Path
from types import ModuleType
from typing import Final

import torch
from torch.utils.backend_registration import (
    generate_methods_for_privateuse1_backend,
    rename_privateuse1_backend,
)

from weightsync.emuaccel import _build, _device
from weightsync.emuaccel._build import EmuBuildError, EmuError

__version__ = _version("weightsync-emuaccel")
"""This distribution's version (from its installed metadata)."""

__all__ = ["DEVICE_TYPE", "EmuBuildError", "EmuError", "build", "install", "set_copy_delay", "synchronizations"]

DEVICE_TYPE: Final = "emu"
"""The device type that ``install()`` returns: ``torch.device(DEVICE_TYPE)`` is the current emu device."""

COPY_DELAY_ENV: Final = "WEIGHTSYNC_EMU_COPY_DELAY_MS"

_lock = threading.Lock()
_installed = False


def install() -> str:
    """Register the emulated accelerator with torch in this process and return its device type, ``"emu"``.

    Idempotent and thread-safe; every process calls it itself (spawned multiprocessing workers and Ray actors do
    not inherit it). The first call loads the compiled library (building it first if this machine has no cached
    build), renames torch's PrivateUse1 backend to ``"emu"``, adds the ``Tensor.emu()``/``is_emu`` methods,
    registers ``torch.emu`` and applies ``WEIGHTSYNC_EMU_COPY_DELAY_MS``. Afterwards
    ``torch.accelerator.current_accelerator()`` is ``device(type='emu')``, pinned memory is pinned for emu, and
    ``torch.Stream``/``torch.Event`` work on it.

    The type is returned without an index so that ``torch.device(install()).type == install()`` and
    ``tensor.to(install())`` lands on the current emu device, as ``"cuda"`` does.
    """
    global _installed
    with _lock:
        if _installed:
            return DEVICE_TYPE
        backend = torch._C._get_privateuse1_backend_name()
        if backend not in ("privateuseone", DEVICE_TYPE):
            raise EmuError(f"torch's PrivateUse1 backend is already {backend!r} in this process; emu cannot install")
        delay_s = _copy_delay_from_env()
        _build.load_library()
        if backend != DEVICE_TYPE:
            rename_privateuse1_backend(DEVICE_TYPE)
        if not hasattr(torch.Tensor, f"is_{DEVICE_TYPE}"):
            generate_methods_for_privateuse1_backend()
        if not hasattr(torch, DEVICE_TYPE):
            # torch._register_device_module is unannotated; called through a typed alias (mypy strict).
            register: Callable[[str, ModuleType], None] = torch._register_device_module
            register(DEVICE_TYPE, _device)
        if delay_s is not None:
            torch.ops.weightsync_emu.set_copy_delay(delay_s)
        _installed = True
    return DEVICE_TYPE


def build() -> Path:
    """Compile the extension for the installed torch unless a build is cached, without registering anything here.

    A test session calls it once before it starts worker processes, so that no worker's first ``install()`` pays
    for the compile (tens of seconds on a fresh machine) under a worker's timeout.
    """
    return _build.ensure_built()


def synchronizations() -> int:
    """How many device-wide synchronizations this process has made (``torch.accelerator.synchronize``,
    ``torch.emu.synchronize``, the device guard's ``synchronizeDevice``).

    Why: waiting on a whole device serialises every stream, which is what a pipeline of stream-ordered copies must
    avoid; a test reads this counter around the code under test to assert it only waits on events and streams
    (which are not counted).
    """
    install()
    return int(torch.ops.weightsync_emu.synchronizations())


def set_copy_delay(seconds: float) -> None:
    """Make every device copy sleep ``seconds`` on its stream's worker before it moves bytes (0 turns it off).

    Why: on an idle machine an asynchronous copy often finishes before the host looks at its destination, so a
    missing wait passes by luck; with a delay the host reads the old bytes instead. Overrides
    ``WEIGHTSYNC_EMU_COPY_DELAY_MS`` for this process; applies to copies queued afterwards.
    """
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"the copy delay must be a finite number of seconds >= 0, got {seconds!r}")
    install()
    torch.ops.weightsync_emu.set_copy_delay(float(seconds))


def _copy_delay_from_env() -> float | None:
    text = os.environ.get(COPY_DELAY_ENV, "").strip()
    if not text:
        return None
    try:
        milliseconds = float(text)
    except ValueError:
        raise EmuError(f"{COPY_DELAY_ENV} must be a number of milliseconds, got {text!r}") from None
    if not math.isfinite(milliseconds) or milliseconds < 0:
        raise EmuError(f"{COPY_DELAY_ENV} must be a finite number of milliseconds >= 0, got {text!r}")
    return milliseconds / 1000.0
