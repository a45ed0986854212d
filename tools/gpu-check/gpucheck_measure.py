"""gpu-check's device measurements (``tools/gpu-check/gpu_check.py`` is the script): ``buckets``, ``copy``,
``legs``, ``bounce``, ``overlap``, ``ipc``, and ``hang`` (the budget's self-test). Each takes the checks' context
and returns its result; the script's child process runs them, one at a time, under their budgets.

``check_ipc`` spawns its second process (``multiprocessing``, spawn) with ``_ipc_child`` as its target: that process
imports this module by name, from the script's folder (on its ``sys.path`` and ``PYTHONPATH``, as the child's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gpucheck_kit import IPC_BUDGET_S, Context, Result

# -- timing, and parameter-like tensors -------------------------------------------------------------------------------


def _timed(ctx: Context, function: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``function`` on the device's current stream, between two timing events (after one
    warm-up)."""
    torch = ctx.torch
    function()
    ctx.synchronize()
    samples = []
    for _ in range(repeats):
        start = torch.Event(device=ctx.device, enable_timing=True)
        end = torch.Event(device=ctx.device, enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    samples.sort()
    return float(samples[len(samples) // 2])


def _wall(ctx: Context, function: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``function`` until the device is done with it (after one warm-up): for paths
    that wait on the host themselves, timed as their caller sees them."""
    function()
    ctx.synchronize()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        ctx.synchronize()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[len(samples) // 2]


def _param_sizes(nbytes: int) -> list[int]:
    """Parameter byte sizes that fill about 90% of a bucket: a mix of large matrices and small vectors."""
    sizes: list[int] = []
    total = index = 0
    while True:
        size = (nbytes // 16) if index % 4 else 8192
        if total + size + 256 > nbytes * 0.9:
            return sizes or [nbytes // 2]
        sizes.append(size)
        total += (size + 255) // 256 * 256
        index += 1


def _params(ctx: Context, nbytes: int) -> list[Any]:
    """Parameter-like bf16 tensors on the device (made on the host for the emulator, which has no kernels)."""
    torch = ctx.torch
    where = "cpu" if ctx.emulated else ctx.device
    return [torch.randn(size // 2, dtype=torch.bfloat16, device=where).to(ctx.device) for size in _param_sizes(nbytes)]


# -- measurements -----------------------------------------------------------------------------------------------------


def check_buckets(ctx: Context) -> Result:
    torch, nbytes = ctx.torch, ctx.args.bucket_mib << 20
    started = time.perf_counter()
    buckets = [torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device) for _ in range(ctx.args.slots)]
    ctx.synchronize()
    seconds = time.perf_counter() - started
    figures = {"alloc_zero_gbps": ctx.args.slots * nbytes / seconds / 1e9}
    if not ctx.emulated:
        free, total = torch.cuda.mem_get_info()
        figures.update(device_free_gib=free / 2**30, device_total_gib=total / 2**30)
    # Its first and last pages read back (a whole bucket's read-back would time the host, not the device).
    zero = all(not bool(bucket[:4096].cpu().any() or bucket[-4096:].cpu().any()) for bucket in buckets)
    del buckets
    return Result("buckets", "ok" if zero else "failed", figures=figures,
                  note="allocated and zeroed" if zero else "a bucket was not zeroed")


def check_copy(ctx: Context) -> Result:
    torch, nbytes = ctx.torch, ctx.args.bucket_mib << 20
    bucket = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(ctx.device)
    other = torch.empty_like(bucket)
    seconds = _timed(ctx, lambda: other.copy_(bucket), ctx.args.repeats)
    same = bool(torch.equal(other.cpu(), bucket.cpu()))
    return Result("copy", "ok" if same else "failed", figures={"d2d_gbps": nbytes / seconds / 1e9},
                  note="device-to-device copy, the yardstick" if same else "the copy differs from its source")


def check_legs(ctx: Context) -> Result:
    torch, nbytes, repeats = ctx.torch, ctx.args.bucket_mib << 20, ctx.args.repeats
    bucket = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    other = torch.empty_like(bucket)
    yardstick = nbytes / _timed(ctx, lambda: other.copy_(bucket), repeats) / 1e9
    # Pack: many parameter-sized tensors into one bucket on a copy stream (what the engine's packing does).
    params = _params(ctx, nbytes)
    copy_stream = torch.Stream(device=ctx.device)
    current = torch.accelerator.current_stream(ctx.device)

    def pack() -> None:
        copy_stream.wait_stream(current)  # the producer's stream first, as the engine's copy stream does
        with copy_stream:
            offset = 0
            for param in params:
                size = param.numel() * 2
                bucket[offset:offset + size].copy_(param.view(torch.uint8))
                offset += (size + 255) // 256 * 256
        current.wait_stream(copy_stream)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    figures = {
        "pack_gbps": nbytes / _timed(ctx, pack, repeats) / 1e9,
        "h2d_pinned_gbps": nbytes / _timed(ctx, lambda: bucket.copy_(pinned, non_blocking=True), repeats) / 1e9,
        "d2h_pinned_gbps": nbytes / _timed(ctx, lambda: pinned.copy_(bucket, non_blocking=True), repeats) / 1e9,
        "d2h_pageable_gbps": nbytes / _timed(ctx, lambda: pageable.copy_(bucket), max(1, repeats // 3)) / 1e9,
    }
    figures.update({f"{key[:-5]}_of_d2d": value / yardstick for key, value in list(figures.items())})
    figures["d2d_gbps"] = yardstick
    return Result("legs", "ok", figures=figures,
                  note="pack is the copy stream's work per bucket; the bounce check times weightsync's own path")


def check_bounce(ctx: Context) -> Result:
    """Weightsync's host bounce against a raw pinned copy of the same bytes, both ways; the bytes compared."""
    torch = ctx.torch
    from weightsync.api.config import BUCKET_ALIGNMENT
    from weightsync.api.testing import raw_bytes
    from weightsync.core.pipeline.planner import plan_buckets
    from weightsync.core.pipeline.bounce import HostBounce
    from weightsync.core.pipeline.unpack import BucketReader, BulkPlans
    from weightsync.core.transports.seam import Arrived
    from weightsync.core.wire.codec import WIRE_VERSION, BucketHeader
    from weightsync.core.wire.digest import UpdateDigest

    nbytes, repeats = ctx.args.bucket_mib << 20, ctx.args.repeats
    params = _params(ctx, nbytes)
    weights = [(f"layers.{index}.weight", param) for index, param in enumerate(params)]
    buckets = list(plan_buckets(weights, bucket_bytes=nbytes, devices=frozenset({"cpu", ctx.device.type})))
    if len(buckets) != 1 or not buckets[0].on_device:
        return Result("bounce", "failed", note=f"planned {len(buckets)} buckets for one bucket of device tensors")
    bucket = buckets[0]
    payload = bucket.payload_bytes
    bounce = HostBounce(ctx.device, bucket_bytes=nbytes)

    def stage() -> None:
        bounce.begin()  # as the planning thread does for an update's first device bucket
        bounce.bounce(bucket, time.monotonic() + 60)

    d2h = _wall(ctx, stage, repeats)
    # A raw copy of the same bytes: one contiguous device buffer into pinned memory, non-blocking, then waited for.
    flat = torch.zeros(payload, dtype=torch.uint8, device=ctx.device)
    raw_host = torch.empty(payload, dtype=torch.uint8, pin_memory=True)
    raw_d2h = _wall(ctx, lambda: raw_host.copy_(flat, non_blocking=True), repeats)
    bounce.host.zero_()
    stage()  # read right after it returns, no synchronize: stage() must have waited for its copies itself
    problems = [f"{name}: staged bytes differ" for (name, param), (meta, _, _) in zip(weights, bucket.items)
                if not torch.equal(bounce.host[meta.bucket_offset:meta.bucket_offset + meta.nbytes],
                                   raw_bytes(param))]

    # H2D: the receiver's unpack of that host bucket into device destinations (each through its typed view and
    # ``copy_``, what a host transport's bucket takes into device memory).
    header = BucketHeader(wire=WIRE_VERSION, epoch="gpu-check", version=1, sender=0, index=0, slot=0,
                          nbytes=bucket.nbytes, tensors=[meta for meta, _, _ in bucket.items])
    destinations = {name: torch.empty_like(param) for name, param in weights}
    host_bucket = bounce.host[:bucket.nbytes]

    def unpack() -> None:
        reader = BucketReader(UpdateDigest(), BulkPlans())
        reader.begin(Arrived(header, host_bucket, token=0))
        reader.copy_out(destinations, None)

    h2d = _wall(ctx, unpack, repeats)
    raw_h2d = _wall(ctx, lambda: flat.copy_(raw_host, non_blocking=True), repeats)
    for destination in destinations.values():
        destination.zero_()
    unpack()
    problems += [f"{name}: unpacked bytes differ" for name, param in weights
                 if not torch.equal(raw_bytes(destinations[name]), raw_bytes(param))]
    figures = {
        "d2h_gbps": payload / d2h / 1e9, "raw_d2h_gbps": payload / raw_d2h / 1e9, "d2h_ratio": raw_d2h / d2h,
        "h2d_gbps": payload / h2d / 1e9, "raw_h2d_gbps": payload / raw_h2d / 1e9, "h2d_ratio": raw_h2d / h2d,
        "tensors": float(len(weights)),
    }
    note = (f"{len(weights)} device tensors ({payload / 2**20:.0f} MiB, {BUCKET_ALIGNMENT}-byte aligned) staged to "
            "a pinned bucket by HostBounce.bounce and unpacked back by BucketReader.copy_out; ratio = raw pinned "
            "non_blocking copy's time / weightsync's")
    return Result("bounce", "failed" if problems else "ok", figures=figures,
                  note="; ".join(problems[:5]) if problems else note)


def check_overlap(ctx: Context) -> Result:
    torch, nbytes, repeats = ctx.torch, ctx.args.bucket_mib << 20, ctx.args.repeats
    a = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    b = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copy_stream, comm_stream = torch.Stream(device=ctx.device), torch.Stream(device=ctx.device)
    current = torch.accelerator.current_stream(ctx.device)

    def serial() -> None:
        copy_stream.wait_stream(current)
        with copy_stream:
            a.copy_(host_a, non_blocking=True)
            host_b.copy_(b, non_blocking=True)
        current.wait_stream(copy_stream)

    def concurrent() -> None:
        # H2D on the copy stream while the "communication" stream moves the other bucket D2H: the two legs the
        # engine overlaps (packing bucket k+1 while bucket k is on the wire).
        copy_stream.wait_stream(current)
        comm_stream.wait_stream(current)
        with copy_stream:
            a.copy_(host_a, non_blocking=True)
        with comm_stream:
            host_b.copy_(b, non_blocking=True)
        current.wait_stream(copy_stream)
        current.wait_stream(comm_stream)

    serial_s = _timed(ctx, serial, repeats)
    concurrent_s = _timed(ctx, concurrent, repeats)
    return Result("overlap", "ok", figures={"serial_ms": serial_s * 1e3, "two_streams_ms": concurrent_s * 1e3,
                                            "ratio": concurrent_s / serial_s},
                  note="an H2D and a D2H copy on one stream, then on two; ratio ~0.5: they run concurrently (copy "
                       "engines in both directions)")


def _ipc_child(queue: Any, answer: Any) -> None:
    import torch

    try:
        tensor, expected = queue.get(timeout=60)
        started = time.perf_counter()
        got = int(tensor.view(torch.int64).sum().item())
        tensor[:8].fill_(7)
        torch.cuda.synchronize()
        answer.put(("ok", got == expected, time.perf_counter() - started))
    except BaseException as exc:
        answer.put(("error", repr(exc), 0.0))


def check_ipc(ctx: Context) -> Result:
    import multiprocessing

    torch, nbytes = ctx.torch, ctx.args.bucket_mib << 20
    context = multiprocessing.get_context("spawn")
    queue, answer = context.Queue(), context.Queue()
    child = context.Process(target=_ipc_child, args=(queue, answer), daemon=True)
    child.start()
    try:
        bucket = torch.randint(0, 1000, (nbytes // 8,), dtype=torch.int64, device=ctx.device).view(torch.uint8)
        expected = int(bucket.view(torch.int64).sum().item())
        torch.cuda.synchronize()
        started = time.perf_counter()
        queue.put((bucket, expected))  # torch's reductions send a CUDA-IPC handle, not the bytes
        status, detail, child_seconds = answer.get(timeout=IPC_BUDGET_S - 10)
        handoff = time.perf_counter() - started
        if status != "ok" or detail is not True:
            return Result("ipc", "failed", handoff, note=f"child: {status} {detail}")
        written = bool((bucket[:8] == 7).all().item())
        return Result("ipc", "ok" if written else "failed", handoff,
                      {"handoff_ms": handoff * 1e3, "child_read_gbps": nbytes / max(child_seconds, 1e-9) / 1e9},
                      note="child mapped the bucket, verified its checksum and wrote back" if written
                      else "the child's write was not visible to the parent")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()


def check_hang(ctx: Context) -> Result:
    """Never returns: a self-test of the budget (run only when named in ``--only``)."""
    while True:
        time.sleep(3600)
