"""The one progress bar `weightsync demo` and `weightsync bench` share: what it writes to stderr, on a terminal
and in a log."""

from __future__ import annotations

import io
import sys

import pytest

from weightsync.cli.progress import Progress


class _Stderr(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _stderr(monkeypatch: pytest.MonkeyPatch, *, tty: bool) -> _Stderr:
    stream = _Stderr(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_in_a_log_every_redraw_is_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _stderr(monkeypatch, tty=False)
    progress = Progress(3)
    progress.show(0, "step 1: training")
    progress.step("step 1: done")
    progress.step("past the end", count=5)
    progress.finish()
    assert stream.getvalue().splitlines() == [
        f"[{'.' * 30}] 0/3 step 1: training",
        f"[{'#' * 10}{'.' * 20}] 1/3 step 1: done",
        f"[{'#' * 30}] 3/3 past the end",
    ]


def test_on_a_terminal_it_redraws_in_place_and_closes_its_line_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _stderr(monkeypatch, tty=True)
    progress = Progress(2)
    progress.step("a longer label first")
    progress.step("short", count=0)  # a label change only: the tail of the longer line is blanked out
    assert "\n" not in stream.getvalue()
    progress.step("done")
    progress.finish()  # the full bar closed its line already
    first, relabelled, full = stream.getvalue().split("\r")[1:]
    assert first == f"[{'#' * 15}{'.' * 15}] 1/2 a longer label first"
    assert relabelled == f"[{'#' * 15}{'.' * 15}] 1/2 short".ljust(len(first))
    assert full == f"[{'#' * 30}] 2/2 done".ljust(len(first)) + "\n"


def test_finish_closes_a_bar_left_short(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _stderr(monkeypatch, tty=True)
    progress = Progress(10)
    progress.step("one")
    progress.finish()
    progress.finish()
    assert stream.getvalue().endswith("one\n") and stream.getvalue().count("\n") == 1


def test_the_clock_shows_seconds_since_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _stderr(monkeypatch, tty=False)
    Progress(0, clock=True).step("warm-up")  # an empty run still draws a bar of one step
    assert stream.getvalue() == f"[{'#' * 30}] 1/1     0s  warm-up\n"
