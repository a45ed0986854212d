"""The CPU instance of the accelerator collective transport: host ops and a gloo group, registered as a test backend.

It runs every line of ``weightsync.core.devicecollective`` that does not need a device (transports, events as
placeholders, digest staging, node-local topology), so the NCCL/HCCL code paths are exercised here through real gloo
groups.
"""

from __future__ import annotations

from typing import Any, ClassVar

from weightsync.api.registry import BackendSpec, module_importable
from weightsync.core.backend import AcceleratorCollectiveTransport, DeviceOps, HostOps, engine_class


class GlooAcceleratorTransport(AcceleratorCollectiveTransport):
    name: ClassVar[str] = "test-accel-gloo"
    devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    device_type: ClassVar[str] = "cpu"

    def make_ops(self, device_index: int | None) -> DeviceOps:
        return HostOps()


GlooAcceleratorEngine = engine_class(GlooAcceleratorTransport)


class RecordingOps(HostOps):
    """Host ops that log every stream/event call, to check the ordering the device engine asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any, Any]] = []
        self._next = 0

    def new_stream(self) -> Any:
        self._next += 1
        return f"stream{self._next}"

    def new_event(self) -> Any:
        self._next += 1
        return f"event{self._next}"

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.calls.append(("wait_event", stream, event))

    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        self.calls.append(("wait_stream", stream, other))

    def record(self, event: Any, stream: Any) -> None:
        self.calls.append(("record", event, stream))


class RecordingTransport(GlooAcceleratorTransport):
    name: ClassVar[str] = "test-accel-recording"
    last_ops: ClassVar[dict[str, RecordingOps]] = {}
    """The ops of the last engine built per role (tests run one world at a time)."""

    def make_ops(self, device_index: int | None) -> DeviceOps:
        ops = RecordingOps()
        RecordingTransport.last_ops[self.settings.context.role] = ops
        return ops


RecordingEngine = engine_class(RecordingTransport)


SPEC = BackendSpec(
    name="test-accel-gloo",
    engine="tests.backends.nccl.accel_gloo:GlooAcceleratorEngine",
    distribution="tests",
    devices=frozenset({"cpu"}),
    cross_node=True,
    probe=lambda: module_importable("torch"),
)
