"""A driver program inside the testbed's Ray cluster, and the test that steers it: JSON lines both ways.

The driver (``DriverChannel``) writes one JSON object per line on a private copy of its stdout (fd 1 becomes stderr:
Ray and torch may print) and, for a message that asks something of the test, waits for one line back on stdin.
The test (``steer``) starts it in the head's host, answers each request through ``on_request``, and returns the
driver's ``{"result": ...}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from weightsync.testbed import TestbedRay

from tests.tools.testbed.support import read_line

DRIVER_TIMEOUT_S = 240.0


class DriverChannel:
    """The driver's end (construct it before anything prints)."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def ask(self, message: dict[str, Any]) -> None:
        """Send ``message`` and wait until the test has done what it asks."""
        self.tell(message)
        if not sys.stdin.readline():
            raise SystemExit("the test went away")

    def tell(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()


def steer(cluster: TestbedRay, argv: Sequence[str], on_request: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run the driver ``argv`` in the head's host; ``on_request(message)`` for each request; its result."""
    driver = cluster.driver(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert driver.stdin is not None
    try:
        while True:
            message = json.loads(read_line(driver, DRIVER_TIMEOUT_S) or "null")
            if not isinstance(message, dict):
                raise AssertionError(f"the driver ended without a result (exit code {driver.wait(30)})")
            if "result" in message:
                return dict(message["result"])
            on_request(message)
            driver.stdin.write(b"done\n")
            driver.stdin.flush()
    finally:
        try:
            driver.wait(30)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait(30)
