"""Asynchronous streams, events and stream-ordered frees, made observable by a delay in every device copy.

Each check that a wait is needed comes with its negative control: the same code without the wait reads the old
bytes (or reuses the block too early), so a pipeline that forgets the wait fails rather than passing by luck.
"""

from __future__ import annotations

import pathlib
import time

import torch

from weightsync.emuaccel import set_copy_delay, synchronizations

DELAY = 0.3
N = 4096


def _expected() -> torch.Tensor:
    return torch.arange(N, dtype=torch.int32)


def _empty_cache(emu: str) -> None:
    """Unmap the blocks earlier tests freed, so that the allocator can only reuse the block a test frees."""
    torch.accelerator.synchronize()
    torch.get_device_module(emu).empty_cache()


def _on_device(emu: str) -> torch.Tensor:
    """The expected values on the device, the copy finished (a copy from pageable memory waits for itself)."""
    return _expected().to(emu)


def test_a_non_blocking_copy_to_pinned_memory_is_stale_until_its_event_completes(emu: str) -> None:
    device = _on_device(emu)
    set_copy_delay(DELAY)
    host = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    host.copy_(device, non_blocking=True)
    copied = torch.Event(device=emu)
    copied.record()
    assert not copied.query()
    assert torch.equal(host, torch.zeros(N, dtype=torch.int32))  # the negative control: read before the wait
    copied.synchronize()
    assert copied.query()
    assert torch.equal(host, _expected())


def test_copies_with_pageable_memory_or_blocking_return_after_they_ran(emu: str) -> None:
    device = _on_device(emu)
    set_copy_delay(DELAY)
    before = synchronizations()
    for host, non_blocking in [(torch.zeros(N, dtype=torch.int32), True),
                               (torch.zeros(N, dtype=torch.int32), False),
                               (torch.zeros(N, dtype=torch.int32).pin_memory(), False)]:
        start = time.monotonic()
        host.copy_(device, non_blocking=non_blocking)
        assert time.monotonic() - start >= DELAY
        assert torch.equal(host, _expected())
    source = _expected()
    uploaded = torch.empty(N, dtype=torch.int32, device=emu)
    uploaded.copy_(source, non_blocking=True)  # pageable: the host may reuse the source at once
    source.zero_()
    assert torch.equal(uploaded.cpu(), _expected())
    assert synchronizations() == before  # those were stream waits, not device-wide ones


def test_negative_control_a_pinned_source_changed_before_its_upload_ran_is_seen_by_the_device(emu: str) -> None:
    set_copy_delay(DELAY)
    source = _expected().pin_memory()
    uploaded = torch.empty(N, dtype=torch.int32, device=emu)
    start = time.monotonic()
    uploaded.copy_(source, non_blocking=True)
    assert time.monotonic() - start < DELAY
    source.zero_()  # too early: the copy has not run yet, as on CUDA
    assert torch.equal(uploaded.cpu(), torch.zeros(N, dtype=torch.int32))


def test_each_stream_runs_in_order_on_a_worker_of_its_own(emu: str) -> None:
    device = _on_device(emu)
    set_copy_delay(DELAY)
    streams = [torch.Stream(device=emu) for _ in range(3)]
    hosts = [torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in streams]
    start = time.monotonic()
    for stream, host in zip(streams, hosts, strict=True):
        with stream:
            staged = torch.empty_like(device)
            staged.copy_(device)  # two copies in order on this stream: the second reads what the first wrote
            host.copy_(staged, non_blocking=True)
    for stream in streams:
        stream.synchronize()
    elapsed = time.monotonic() - start
    assert all(torch.equal(host, _expected()) for host in hosts)
    # Three streams of two delayed copies each: in parallel about 2 delays, in series 6.
    assert 2 * DELAY <= elapsed < 4 * DELAY


def test_a_stream_waits_for_an_event_recorded_on_another(emu: str) -> None:
    device = _on_device(emu)
    producer, consumer = torch.Stream(device=emu), torch.Stream(device=emu)
    set_copy_delay(DELAY)
    staged = torch.zeros(N, dtype=torch.int32, device=emu)
    producer.wait_stream(torch.accelerator.current_stream())  # both after the zero fill
    consumer.wait_stream(torch.accelerator.current_stream())
    waited, unwaited = (torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in range(2))
    with producer:
        staged.copy_(device)
        ready = torch.Event(device=emu)
        ready.record(producer)
    with consumer:
        set_copy_delay(0.0)
        unwaited.copy_(staged, non_blocking=True)  # the negative control: no wait, reads before the producer wrote
        consumer.wait_event(ready)
        waited.copy_(staged, non_blocking=True)
    consumer.synchronize()
    assert torch.equal(unwaited, torch.zeros(N, dtype=torch.int32))
    assert torch.equal(waited, _expected())


def test_wait_stream_orders_after_everything_queued_on_the_other(emu: str) -> None:
    device = _on_device(emu)
    first, second = torch.Stream(device=emu), torch.Stream(device=emu)
    set_copy_delay(DELAY)
    staged = torch.zeros(N, dtype=torch.int32, device=emu)
    first.wait_stream(torch.accelerator.current_stream())
    host = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    with first:
        staged.copy_(device)
    assert not first.query()
    second.wait_stream(first)
    with second:
        host.copy_(staged, non_blocking=True)
    second.synchronize()
    assert first.query() and torch.equal(host, _expected())


def test_only_device_wide_synchronizations_are_counted(emu: str) -> None:
    device = _on_device(emu)
    side = torch.Stream(device=emu)
    event = torch.Event(device=emu)
    before = synchronizations()
    with side:
        device.cpu()
        event.record(side)
    event.synchronize()
    side.synchronize()
    torch.accelerator.current_stream().wait_event(event)
    torch.accelerator.current_stream().wait_stream(side)
    torch.accelerator.current_stream().synchronize()
    assert synchronizations() == before
    torch.accelerator.synchronize()
    assert synchronizations() == before + 1
    torch.emu.synchronize()  # type: ignore[attr-defined]
    assert synchronizations() == before + 2


def test_a_device_wide_synchronization_waits_for_every_stream(emu: str) -> None:
    device = _on_device(emu)
    set_copy_delay(DELAY)
    streams = [torch.Stream(device=emu) for _ in range(2)]
    hosts = [torch.zeros(N, dtype=torch.int32, pin_memory=True) for _ in streams]
    for stream, host in zip(streams, hosts, strict=True):
        with stream:
            host.copy_(device, non_blocking=True)
    torch.accelerator.synchronize()
    assert all(stream.query() for stream in streams)
    assert all(torch.equal(host, _expected()) for host in hosts)


def test_event_timing(emu: str) -> None:
    device = _on_device(emu)
    set_copy_delay(DELAY)
    start, end = torch.Event(device=emu, enable_timing=True), torch.Event(device=emu, enable_timing=True)
    start.record()
    device.clone()
    end.record()
    end.synchronize()  # as on CUDA, both events must have completed
    assert start.elapsed_time(end) >= DELAY * 1000


def test_a_freed_block_is_not_reused_before_its_recorded_streams_ran(emu: str) -> None:
    _empty_cache(emu)
    source = _on_device(emu)
    address = source.data_ptr()
    side = torch.Stream(device=emu)
    side.wait_stream(torch.accelerator.current_stream())
    set_copy_delay(DELAY)
    host = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    with side:
        host.copy_(source, non_blocking=True)  # still reading `source` after the free below
    source.record_stream(side)
    torch.accelerator.current_stream().synchronize()  # only the side stream still has work on the block
    del source
    reused = torch.empty(N, dtype=torch.int32, device=emu)
    assert reused.data_ptr() != address
    reused.fill_(-1)
    side.synchronize()
    assert torch.equal(host, _expected())
    again = torch.empty(N, dtype=torch.int32, device=emu)
    assert again.data_ptr() == address  # once the side stream has run, the block is free to reuse


def test_negative_control_without_record_stream_the_block_is_reused_under_the_reader(emu: str) -> None:
    _empty_cache(emu)
    source = _on_device(emu)
    address = source.data_ptr()
    side = torch.Stream(device=emu)
    side.wait_stream(torch.accelerator.current_stream())
    set_copy_delay(DELAY)
    host = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    with side:
        host.copy_(source, non_blocking=True)
    torch.accelerator.current_stream().synchronize()
    del source  # its allocation stream has nothing pending: the block is free at once
    reused = torch.empty(N, dtype=torch.int32, device=emu)
    assert reused.data_ptr() == address
    reused.fill_(-1)  # runs on the idle default stream before the side stream's delayed copy reads
    side.synchronize()
    assert torch.equal(host, torch.full((N,), -1, dtype=torch.int32))


def _emu_threads() -> int:
    return sum(1 for comm in pathlib.Path("/proc/self/task").glob("*/comm") if comm.read_text().startswith("emu"))


def test_idle_stream_workers_exit_and_come_back(emu: str) -> None:
    device = _on_device(emu)
    streams = [torch.Stream(device=emu) for _ in range(8)]
    for stream in streams:
        with stream:
            device.clone()
    assert _emu_threads() >= len(streams)
    torch.accelerator.synchronize()
    deadline = time.monotonic() + 10
    while _emu_threads() > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _emu_threads() == 0  # a stream per transfer does not pile up threads
    host = torch.zeros(N, dtype=torch.int32, pin_memory=True)
    with streams[0]:
        host.copy_(device, non_blocking=True)
    streams[0].synchronize()
    assert torch.equal(host, _expected())
