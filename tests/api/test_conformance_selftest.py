"""The conformance kit must fail a transport that corrupts bytes — whichever side the corruption is on."""

from __future__ import annotations

import pytest

from weightsync.api.testing import ConformanceFailure, EngineHarness, WorkerFailed


def _run(hook: str) -> None:
    harness = EngineHarness("shm", receivers=2, options={"transport_hook": hook}, timeout=60)
    harness.start()
    try:
        harness.setup()
        harness.update("mixed")
    finally:
        harness.close()


def test_kit_fails_a_sender_that_corrupts_before_hashing() -> None:
    # The digest cannot see this corruption (it is hashed as sent): only the kit's byte comparison can.
    with pytest.raises(ConformanceFailure, match="bytes differ"):
        _run("tests.workloads:FLIP_AFTER_PACK")


def test_kit_fails_a_transport_that_corrupts_in_transit() -> None:
    with pytest.raises(WorkerFailed) as caught:
        _run("tests.workloads:FLIP_AFTER_RECEIVE")
    assert caught.value.error_type == "DigestMismatchError"
