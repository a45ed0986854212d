"""The accelerator collective transport (what nccl and hccl instantiate) on the emulated accelerator, with gloo
standing in for NCCL/HCCL, registered as a test backend.

It runs every line of ``weightsync.core.transports.collective.device`` — device rings, copy and comm streams ordered by
events, digest staging, node-local topology — on a device whose memory the host cannot touch and whose streams are
asynchronous (``weightsync.emuaccel``). gloo cannot touch that memory either, so the stand-in group copies each device
tensor to pinned host memory, broadcasts it, and copies it back, on the caller's stream (the comm stream), ordered by
events: what NCCL does on the device, in three steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from weightsync.api.registry import BackendSpec, module_importable
from weightsync.core.backend import (
    AcceleratorCollectiveTransport, AcceleratorOps, engine_class, gloo_group, process_accelerator, wait_event,
)


class HostBounceGroup:
    """A gloo group standing in for a device collective: device tensors go through pinned host memory."""

    landing_delay: ClassVar[float | None] = None
    """Seconds the copy of received bytes onto the device waits, when set (a negative control makes the landing
    slower than the consumer's reads, which the emulator delays too)."""

    def __init__(self, gloo: Any, ops: AcceleratorOps, rank: int, timeout: float) -> None:
        self.gloo = gloo
        self.ops = ops
        self.rank = rank
        self.timeout = timeout
        self._in_flight: list[tuple[Any, torch.Tensor]] = []
        """Host copies still being copied to the device, kept alive until their event completed."""

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> Any:
        tensor, ops = tensors[0], self.ops
        stream = ops.current_stream()
        self._in_flight = [(event, host) for event, host in self._in_flight if not ops.query(event)]
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        if self.rank == options.rootRank:
            host.copy_(tensor, non_blocking=True)
            staged = ops.new_event()
            ops.record(staged, stream)
            wait_event(ops, staged, time.monotonic() + self.timeout, peer="local device", what="staging")
        work = self.gloo.broadcast([host], options)
        work.wait()
        if self.rank != options.rootRank:
            with _slower(self.landing_delay):
                tensor.copy_(host, non_blocking=True)  # queued on the comm stream, like the real collective
            landed = ops.new_event()
            ops.record(landed, stream)
            self._in_flight.append((landed, host))
        return work

    def __getattr__(self, name: str) -> Any:  # shutdown, abort
        return getattr(self.gloo, name)


@contextlib.contextmanager
def _slower(seconds: float | None) -> Iterator[None]:
    if seconds is None:
        yield
        return
    from weightsync.emuaccel import set_copy_delay

    from tests.devices import COPY_DELAY

    set_copy_delay(seconds)
    try:
        yield
    finally:
        set_copy_delay(COPY_DELAY)


def _device(index: int | None) -> torch.device:
    """The process's accelerator (a real GPU under tools/gpu-check), else the emulated one, registered here."""
    device = process_accelerator()
    if device is None:
        from weightsync.emuaccel import install

        device = torch.device(install(), 0)
    return device if index is None else torch.device(device.type, index)


class GlooAcceleratorTransport(AcceleratorCollectiveTransport):
    name: ClassVar[str] = "test-accel-gloo"
    devices: ClassVar[frozenset[str]] = frozenset({"emu", "cuda"})

    def make_ops(self, device_index: int | None) -> AcceleratorOps:
        return AcceleratorOps(_device(device_index))

    def new_group(self, store: Any, rank: int, size: int) -> Any:
        group = gloo_group(store, rank, size, timeout=self.settings.timeout, host_ip=self.settings.context.host_ip)
        return HostBounceGroup(group, self._ops, rank, self.settings.timeout)


GlooAcceleratorEngine = engine_class(GlooAcceleratorTransport)


class RecordingOps(AcceleratorOps):
    """The emulated device's ops, logging every stream/event call (streams and events by name, in order of
    creation), to check the ordering the device engine asks for."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.calls: list[tuple[str, str, str]] = []
        self._names: list[tuple[Any, str]] = []

    def _name(self, thing: Any) -> str:
        return next((name for known, name in self._names if known is thing), "other")

    def _named(self, thing: Any, kind: str) -> Any:
        self._names.append((thing, f"{kind}{len(self._names) + 1}"))
        return thing

    def new_stream(self) -> Any:
        return self._named(super().new_stream(), "stream")

    def new_event(self) -> Any:
        return self._named(super().new_event(), "event")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self.calls.append(("wait_event", self._name(stream), self._name(event)))
        super().stream_wait_event(stream, event)

    def stream_wait_stream(self, stream: Any, other: Any) -> None:
        self.calls.append(("wait_stream", self._name(stream), self._name(other)))
        super().stream_wait_stream(stream, other)

    def record(self, event: Any, stream: Any) -> None:
        self.calls.append(("record", self._name(event), self._name(stream)))
        super().record(event, stream)


class RecordingTransport(GlooAcceleratorTransport):
    name: ClassVar[str] = "test-accel-recording"
    last_ops: ClassVar[dict[str, RecordingOps]] = {}
    """The ops of the last engine built per role (tests run one world at a time)."""

    def make_ops(self, device_index: int | None) -> AcceleratorOps:
        ops = RecordingOps(_device(device_index))
        RecordingTransport.last_ops[self.settings.context.role] = ops
        return ops


RecordingEngine = engine_class(RecordingTransport)


SPEC = BackendSpec(
    name="test-accel-gloo",
    engine="tests.backends.nccl.accel_gloo:GlooAcceleratorEngine",
    distribution="tests",
    devices=frozenset({"emu", "cuda"}),
    cross_node=True,
    probe=lambda: module_importable("torch"),
)
