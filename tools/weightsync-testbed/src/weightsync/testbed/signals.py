"""Signals around a testbed's life: SIGTERM/SIGHUP become exceptions, and teardown is not cut short by Ctrl-C.

Python turns SIGINT into KeyboardInterrupt, so ``with Testbed(...)`` tears down on Ctrl-C by itself; SIGTERM and
SIGHUP kill a Python process without unwinding. While a testbed is open (and only where the process left them at
their defaults), they raise SystemExit(128 + signal) instead, so the context manager and atexit run. During
teardown these signals are held back and re-delivered once it is done: a second Ctrl-C must not leave half a
testbed behind. Signal handlers belong to the main thread; from other threads both are no-ops.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["deferred_signals", "hold_exit_signals", "release_exit_signals"]

_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_lock = threading.Lock()
_holders = 0
_installed: dict[int, bool] = {}


def _raise_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def hold_exit_signals() -> None:
    """One more open testbed: make SIGTERM/SIGHUP unwind (where they are at their defaults)."""
    global _holders
    with _lock:
        _holders += 1
        if _holders > 1 or not _main_thread():
            return
        for signum in _EXIT_SIGNALS:
            _installed[signum] = signal.getsignal(signum) == signal.SIG_DFL
            if _installed[signum]:
                signal.signal(signum, _raise_exit)


def release_exit_signals() -> None:
    """One testbed fewer: with none left open, put back the defaults we replaced."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders > 0 or not _main_thread():
            return
        for signum, installed in _installed.items():
            if installed and signal.getsignal(signum) is _raise_exit:
                signal.signal(signum, signal.SIG_DFL)
        _installed.clear()


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back for the block; deliver them (once each) after it."""
    if not _main_thread():
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        if signum not in received:
            received.append(signum)

    signums = (signal.SIGINT, *_EXIT_SIGNALS)
    previous = {signum: signal.signal(signum, record) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            # None: a handler not installed from Python; there is nothing we could put back, so leave ours off.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for pending in received:
            signal.raise_signal(pending)
