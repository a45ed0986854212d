"""Every reliability test (faults, bad inputs, early exits) must leave no asyncio task whose exception nobody
retrieved: after a failed step the manager awaits and reads every sibling call (``weightsync.core.control.steps``),
so a "Task exception was never retrieved" record is a defect, found here after each test."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator

import pytest


class NeverRetrieved(logging.Handler):
    """Collects asyncio's "Task exception was never retrieved" records (logged when such a task is collected); of
    nested checkers only the innermost (a negative control's inside a test's)."""

    _open: list[NeverRetrieved] = []

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "exception was never retrieved" in record.getMessage() and self._open[-1] is self:
            self.found.append(record.getMessage())

    def __enter__(self) -> NeverRetrieved:
        self._open.append(self)
        logging.getLogger("asyncio").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.collect()  # a forgotten task reports when it is collected
        logging.getLogger("asyncio").removeHandler(self)
        self._open.remove(self)


@pytest.fixture(autouse=True)
def no_exception_left_unretrieved() -> Iterator[None]:
    with NeverRetrieved() as handler:
        yield
    assert not handler.found, handler.found
