"""The conformance kit every backend's tests subclass (extra ``weightsync-api[testing]``; never imports Ray).

Usage, in a backend's test module::

    from weightsync.api.testing import EngineConformance

    class TestShmConformance(EngineConformance):
        @pytest.fixture(scope="class")
        def backend(cls) -> str:
            return "shm"

Fixtures to override: ``backend`` (required), ``engine_options``, ``receivers``, ``bucket_bytes``, and where the
tensors live: ``device`` (``"cpu"``, an accelerator's device type such as ``"cuda"``, or ``"module:function"``
that registers a device in each worker process and returns its type, e.g. ``"weightsync.emuaccel:install"``) and
``placement`` (``"device"``: every source and destination on it; ``"mixed"``: host and device interleaved), and
``hosts``: which pretend host each worker is on (entry 0 the sender, then the receivers; ``None``: this host) —
workers on different pretend hosts advertise different node ids, so a host-aware topology treats them as apart
(they still share this machine's memory). The kit
starts one sender and ``receivers`` receiver processes per test class and runs every case through the full
lifecycle.
Comparison is by raw bytes, inside the receiver's loop. A bucket engine of weightsync's is built with
``check_transport=True`` in every case (``checked_options``), so the rules between its pipeline and its transport —
tokens, views valid until release, releases in order, slots reused only after ``wait_slot`` — are checked too
(``weightsync.core.transports.transport`` states them). The kit is tested against transports that corrupt a byte
or break those rules (see ``tests/api/test_conformance_selftest.py``): it must fail them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.api.testing.cases import CASES, PLACEMENTS, case_tensors, on_device, place, raw_bytes
from weightsync.api.testing.harness import ConformanceFailure, EngineHarness, WorkerFailed, checked_options

__all__ = [
    "CASES",
    "PLACEMENTS",
    "case_tensors",
    "on_device",
    "place",
    "raw_bytes",
    "ConformanceFailure",
    "EngineHarness",
    "WorkerFailed",
    "EngineConformance",
    "checked_options",
]


class EngineConformance:
    """Cases every engine must pass. Subclass it and override the fixtures, nothing else."""

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls) -> str:
        raise NotImplementedError("override the `backend` fixture with the backend's registry name")

    @pytest.fixture(scope="class")
    @classmethod
    def engine_options(cls) -> dict[str, Any]:
        return {}

    @pytest.fixture(scope="class")
    @classmethod
    def receivers(cls) -> int:
        return 2

    @pytest.fixture(scope="class")
    @classmethod
    def bucket_bytes(cls) -> int:
        return 1 << 20

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls) -> str:
        return "cpu"

    @pytest.fixture(scope="class")
    @classmethod
    def placement(cls) -> str:
        return "device"

    @pytest.fixture(scope="class")
    @classmethod
    def hosts(cls) -> list[int] | None:
        return None

    @pytest.fixture(scope="class")
    @classmethod
    def harness(
        cls, backend: str, engine_options: dict[str, Any], receivers: int, bucket_bytes: int, device: str,
        placement: str, hosts: list[int] | None,
    ) -> Iterator[EngineHarness]:
        harness = EngineHarness(backend, receivers=receivers, bucket_bytes=bucket_bytes,
                                options=checked_options(backend, engine_options), device=device,
                                placement=placement, hosts=hosts)
        harness.start()
        try:
            harness.setup()
            yield harness
        finally:
            harness.close()

    def test_every_dtype(self, harness: EngineHarness) -> None:
        results = harness.update("dtypes")
        assert all(result["count"] == len(case_tensors("dtypes", 0, harness.bucket_bytes)) for result in results[1:])

    def test_zero_size_and_scalar(self, harness: EngineHarness) -> None:
        harness.update("zero_size")

    def test_non_contiguous(self, harness: EngineHarness) -> None:
        harness.update("non_contiguous")

    def test_tensor_three_buckets_long(self, harness: EngineHarness) -> None:
        sender = harness.update("three_buckets")[0]
        assert sender["buckets"] >= 4

    def test_thousand_small_tensors(self, harness: EngineHarness) -> None:
        results = harness.update("many_small")
        assert all(result["count"] == 1000 for result in results[1:])

    def test_long_names(self, harness: EngineHarness) -> None:
        results = harness.update("long_names")
        assert all(result["count"] == 400 for result in results[1:])

    def test_partial_update(self, harness: EngineHarness) -> None:
        harness.update("mixed", 1)
        results = harness.update("partial", 2)
        assert all(result["count"] == len(case_tensors("partial", 2, harness.bucket_bytes)) for result in results[1:])

    def test_two_consecutive_updates(self, harness: EngineHarness) -> None:
        first = harness.update("mixed", 3)
        second = harness.update("mixed", 4)
        assert first[0]["digest"] != second[0]["digest"]

    @pytest.mark.parametrize("case", ["dtypes", "zero_size", "three_buckets", "many_small", "mixed"])
    def test_copy_into(self, harness: EngineHarness, case: str) -> None:
        results = harness.update(case, 6, mode="copy_into")
        assert all(result["count"] == len(case_tensors(case, 6, harness.bucket_bytes)) for result in results[1:])

    def test_copy_into_rejects_a_destination_of_another_shape(self, harness: EngineHarness) -> None:
        results = harness.update("mixed", 7, mode="wrong_shape")
        assert all(result["raised"] == "DestinationError" for result in results[1:])
        harness.update("mixed", 8, mode="copy_into")  # the engines are fine afterwards

    def test_delta_updates(self, harness: EngineHarness) -> None:
        """With ``delta=True`` (engines of their own, set up like the class's): the first update goes full, each
        next one as its changes, a few % of the bytes; every receiver holds the sender's exact bytes, the first
        changing its own tensors in place, the others iterating views (the engine then keeps a copy to rebuild them
        from). An engine that cannot send deltas refuses the option with a ``ConfigError`` (skipped here)."""
        try:
            from weightsync.core.delta.encoding import ENCODER
        except ImportError:
            ENCODER = "compiled"  # an engine of another project: its own encoder
        if ENCODER != "compiled":
            pytest.skip(f"delta updates here: {ENCODER}")
        delta = harness.alike(delta=True)
        try:
            try:
                delta.start()
            except WorkerFailed as exc:
                if exc.error_type != "ConfigError":
                    raise
                pytest.skip(f"{harness.backend} refuses delta=True: {exc.text.splitlines()[0]}")
            delta.setup()
            for update in range(4):
                sender = delta.update("delta", update, mode=["in_place", *["iterate"] * (delta.receivers - 1)])[0]
                if update == 0:
                    assert sender["base"] == -1 and sender["wire_bytes"] >= sender["nbytes"], sender
                else:
                    assert sender["base"] >= 0, f"update {update} went full: {sender}"
                    assert sender["wire_bytes"] < 0.25 * sender["nbytes"], sender
        finally:
            delta.close()

    def test_new_epoch_after_rebuild(self, harness: EngineHarness) -> None:
        harness.setup()
        harness.update("mixed", 5)
