#!/usr/bin/env python3
"""gpu-check: what one accelerator machine tells us about weightsync's device path, in at most eight minutes.

Runs on a machine with a GPU and no network, with that machine's own (CUDA) torch plus our wheels, from a checkout
of this repository (the conformance step uses ``tests/devices.py`` and the test backend in
``tests/backends/nccl/accel_gloo.py``). Without CUDA it runs on the emulated accelerator (``weightsync.emuaccel``,
device ``emu``): the same code, so CI runs it too (``--device emu --quick``); only what needs CUDA is skipped.

What to carry, and how to build it (on a machine with network, from the repository root)::

    python -m pip wheel --no-deps -w gpu-wheels packages/weightsync-api packages/weightsync-core \\
        packages/weightsync-shm packages/weightsync-gloo packages/weightsync-nixl packages/weightsync-mooncake \\
        packages/weightsync-nccl
    python -m pip download --no-deps -d gpu-wheels msgspec xxhash typing-extensions pytest iniconfig pluggy \\
        packaging   # those the GPU machine lacks (the conformance kit imports pytest)
    # carry: gpu-wheels/ and the repository checkout (tools/gpu-check/gpu_check.py, tests/)

On the GPU machine (no network)::

    python -m pip install --no-index --no-deps gpu-wheels/*.whl      # never reinstalls torch
    python tools/gpu-check/gpu_check.py           # or: --quick, --json out.json, --only staging,shm/device

A backend whose library is not installed there (nixl, mooncake) is reported as skipped, with the reason.

Checks, in this order, each in a bounded time (``--check-budget``; all of them together at most ``--budget``, 480 s):

1. ``buckets``  — allocate and zero ``--slots`` buckets of ``--bucket-mib`` in device memory (what the engine keeps).
2. ``copy``     — the device's own copy bandwidth (device-to-device ``copy_`` of a bucket), the yardstick.
3. ``legs``     — the pipeline's legs: pack (D2D from scattered parameters into a bucket, on a copy stream), H2D and
   D2H between pinned host memory and a bucket, D2H into pageable memory; each as GB/s and as a fraction of (2).
4. ``staging``  — weightsync's own staging path between device tensors and a host bucket: D2H through
   ``weightsync.core.staging.SendStaging.stage`` (what a sender does for a host transport) and H2D through the
   receiver's unpack (``weightsync.core.unpack.BucketReader.copy_out`` into device destinations), each in GB/s and
   as a ratio to a raw pinned ``non_blocking`` copy of the same bytes; the bytes are compared both ways.
5. ``overlap``  — an H2D and a D2H bucket copy one after the other on one stream, then at once on a copy stream and
   a second ("communication") stream; ratio near 0.5 means they overlap.
6. ``ipc``      — CUDA-IPC hand-off of a device bucket to a second process on the same GPU (``torch.multiprocessing``
   reductions: the mechanism checkpoint-engine's ParameterServer uses): the child maps it, verifies a checksum and
   writes back; reports the hand-off latency. CUDA only.
7. conformance — the conformance kit (``weightsync.api.testing``: every test of ``EngineConformance``, run here in
   a loop with one ``EngineHarness`` per line) with sources and destinations on the device, 1 MiB buckets:
   ``shm``, ``gloo``, ``nixl``, ``mooncake`` through host rings (``<backend>/device``, ``<backend>/mixed``: all
   tensors on the device, or host and device interleaved); ``nixl`` and ``mooncake`` with device rings
   (``<backend>/cuda-ring/...``, engine option ``device="cuda"``; CUDA only); the accelerator collective engine
   that nccl and hccl instantiate, with a gloo group standing in for NCCL (``accel-gloo/...``, the test backend
   ``test-accel-gloo``); and ``nccl`` itself where two or more GPUs are visible. On ``emu`` every device copy is
   delayed (``tests.devices``), so a missing wait shows as wrong bytes.

Devices (``--device``): ``auto`` (CUDA if torch sees it, else ``emu``), ``cuda``, ``emu``. On ``emu`` the figures
exercise the code; they are not a device's. ``--quick``: 64 MiB buckets, 3 repeats, one receiver, the ``mixed``
placement only, and the kit's slowest tests left out (every backend still runs). ``--only NAMES`` runs the named
checks (comma-separated, as printed; ``hang``, a check that never returns, is the self-test of the budget).

How it stays bounded: the checks run in a child process, which reports each check's start and result; a check
that runs past its budget is failed and the child (with every process it started) is killed, and a fresh child
carries on with the remaining checks. The last line printed is a one-line summary, e.g.
``gpu-check: device=emu ok=12 failed=0 skipped=5 (ipc: needs CUDA, ...) in 143 s``. ``--json PATH`` also writes
``{"device", "torch", "seconds", "summary", "results": [...]}`` (it used to be the list of results alone).

Exit codes: 0 all checks passed (skips allowed), 1 a check failed (or ran past its budget), 2 bad arguments
(argparse; an unknown ``--only`` name), 3 our wheels (or the modules they need) are missing, 4 the requested device
is not here (``--device cuda`` without CUDA, or ``emu`` without ``weightsync-emuaccel``; nothing measured).
``--device auto`` on a machine without CUDA runs on ``emu`` (it used to exit 4). ``--dry-run`` parses arguments
and checks imports only (used by the CPU test suite).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS, EXIT_NO_WHEELS, EXIT_NO_DEVICE = 0, 1, 2, 3, 4
REQUIRED_MODULES = ("weightsync.api", "weightsync.core", "msgspec", "xxhash", "pytest")
"""What every check needs: our two core wheels, what they import, and pytest (the conformance kit imports it)."""

REPO = pathlib.Path(__file__).resolve().parents[2]
"""The repository checkout this script lives in (tools/gpu-check/gpu_check.py)."""
CHECKOUT_TESTS = REPO / "tests" / "backends" / "nccl" / "accel_gloo.py"

TOTAL_BUDGET_S = 480.0
"""At most eight minutes in all."""
STARTUP_BUDGET_S = 240.0
"""For the child to import torch and register its device (the emulator's first use on a machine compiles it)."""
MEASURE_BUDGET_S, IPC_BUDGET_S, CONFORMANCE_BUDGET_S = 60.0, 90.0, 150.0
"""Each check's own budget, unless ``--check-budget`` says otherwise."""

HOST_RING_BACKENDS = ("shm", "gloo", "nixl", "mooncake")
DEVICE_RING_BACKENDS = ("nixl", "mooncake")
ACCEL_GLOO = "test-accel-gloo"
KIT_BUCKET_BYTES = 1 << 20
QUICK_LEAVES_OUT = ("test_thousand_small_tensors", "test_long_names", "test_two_consecutive_updates",
                    "test_copy_into[dtypes]", "test_copy_into[zero_size]", "test_copy_into[many_small]")
"""The kit's tests ``--quick`` leaves out: the slowest on the emulated device, and those whose code path another
test already takes (any test the kit adds runs in ``--quick`` too)."""


@dataclass
class Result:
    check: str
    status: str  # "ok", "failed", "skipped"
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)
    note: str = ""
    reason: str = ""
    """Why it was skipped, in a few words (the summary line's)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--device", choices=("auto", "cuda", "emu"), default="auto",
                        help="auto (default): cuda if torch sees a CUDA device, else the emulated accelerator")
    parser.add_argument("--bucket-mib", type=int, default=256, help="bucket size in MiB (default 256)")
    parser.add_argument("--slots", type=int, default=2, help="buckets per side (default 2)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions per leg (default 10)")
    parser.add_argument("--quick", action="store_true",
                        help="64 MiB buckets, 3 repeats, a shorter conformance run (every backend still runs)")
    parser.add_argument("--skip-nccl", action="store_true", help="do not run the NCCL conformance suite")
    parser.add_argument("--only", metavar="NAMES", help="run only these checks (comma-separated, as printed)")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                        help=f"seconds for everything (default, and at most, {TOTAL_BUDGET_S:.0f})")
    parser.add_argument("--check-budget", type=float, metavar="S",
                        help=f"seconds per check (default {MEASURE_BUDGET_S:.0f} for a measurement, "
                             f"{CONFORMANCE_BUDGET_S:.0f} for a conformance line)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--dry-run", action="store_true", help="parse arguments and check imports, measure nothing")
    # The child that runs the checks (see the module docstring): where it reports.
    parser.add_argument("--run-checks", metavar="PROGRESS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bucket_mib < 1 or args.slots < 1 or args.repeats < 1:
        parser.error("--bucket-mib, --slots and --repeats must be positive")
    if not 0 < args.budget <= TOTAL_BUDGET_S or (args.check_budget is not None and args.check_budget <= 0):
        parser.error(f"--budget must be in (0, {TOTAL_BUDGET_S:.0f}] and --check-budget positive")
    if args.quick:
        args.bucket_mib, args.repeats = 64, 3
    return args


def missing_modules() -> list[str]:
    """Required modules that cannot be found (looked up without importing torch)."""
    missing = []
    for module in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    return missing


# -- the checks' context ----------------------------------------------------------------------------------------------


@dataclass
class Context:
    torch: Any
    device: Any  # torch.device of the accelerator, with its index
    args: argparse.Namespace
    kit_device: str
    """The conformance kit's ``device``: ``"cuda"``, or ``"module:function"`` registering the emulated device."""

    @property
    def emulated(self) -> bool:
        return bool(self.device.type != "cuda")

    def synchronize(self) -> None:
        self.torch.accelerator.synchronize()


def resolve_device(torch: Any, requested: str) -> tuple[Any, str]:
    """The accelerator to run on (registering the emulated one in this process), or None and why not."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "emu"
    if requested == "cuda":
        if torch.version.cuda is None or not torch.cuda.is_available():
            return None, (f"no CUDA device here (torch {torch.__version__}, torch.version.cuda={torch.version.cuda});"
                          " run this on a GPU machine with a CUDA build of torch, or with --device emu")
        return torch.device("cuda", torch.cuda.current_device()), ""
    try:
        from weightsync.emuaccel import install
    except ImportError as exc:
        return None, (f"--device emu needs weightsync-emuaccel (tools/weightsync-emuaccel), which does not import: "
                      f"{exc}")
    device_type = install()
    return torch.device(device_type, torch.accelerator.current_device_index()), ""


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
                  note="pack is the copy stream's work per bucket; the staging check times weightsync's own path")


def check_staging(ctx: Context) -> Result:
    """Weightsync's staging path against a raw pinned copy of the same bytes, both ways; the bytes compared."""
    torch = ctx.torch
    from weightsync.api.config import BUCKET_ALIGNMENT
    from weightsync.api.testing import raw_bytes
    from weightsync.core.codec import WIRE_VERSION, BucketHeader
    from weightsync.core.digest import UpdateDigest
    from weightsync.core.planner import plan_buckets
    from weightsync.core.staging import SendStaging
    from weightsync.core.unpack import Arrived, BucketReader, BulkPlans

    nbytes, repeats = ctx.args.bucket_mib << 20, ctx.args.repeats
    params = _params(ctx, nbytes)
    weights = [(f"layers.{index}.weight", param) for index, param in enumerate(params)]
    buckets = list(plan_buckets(weights, bucket_bytes=nbytes, devices=frozenset({"cpu", ctx.device.type})))
    if len(buckets) != 1 or not buckets[0].on_device:
        return Result("staging", "failed", note=f"planned {len(buckets)} buckets for one bucket of device tensors")
    bucket = buckets[0]
    payload = bucket.payload_bytes
    staging = SendStaging(ctx.device, bucket_bytes=nbytes)

    def stage() -> None:
        staging.begin()  # as the planning thread does for an update's first device bucket
        staging.stage(bucket, time.monotonic() + 60)

    d2h = _wall(ctx, stage, repeats)
    # A raw copy of the same bytes: one contiguous device buffer into pinned memory, non-blocking, then waited for.
    flat = torch.zeros(payload, dtype=torch.uint8, device=ctx.device)
    raw_host = torch.empty(payload, dtype=torch.uint8, pin_memory=True)
    raw_d2h = _wall(ctx, lambda: raw_host.copy_(flat, non_blocking=True), repeats)
    staging.host.zero_()
    stage()  # read right after it returns, no synchronize: stage() must have waited for its copies itself
    problems = [f"{name}: staged bytes differ" for (name, param), (meta, _, _) in zip(weights, bucket.items)
                if not torch.equal(staging.host[meta.bucket_offset:meta.bucket_offset + meta.nbytes],
                                   raw_bytes(param))]

    # H2D: the receiver's unpack of that host bucket into device destinations (each through its typed view and
    # ``copy_``, what a host transport's bucket takes into device memory).
    header = BucketHeader(wire=WIRE_VERSION, epoch="gpu-check", version=1, sender=0, index=0, slot=0,
                          nbytes=bucket.nbytes, tensors=[meta for meta, _, _ in bucket.items])
    destinations = {name: torch.empty_like(param) for name, param in weights}
    host_bucket = staging.host[:bucket.nbytes]

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
            "a pinned bucket by SendStaging.stage and unpacked back by BucketReader.copy_out; ratio = raw pinned "
            "non_blocking copy's time / weightsync's")
    return Result("staging", "failed" if problems else "ok", figures=figures,
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


# -- conformance ------------------------------------------------------------------------------------------------------


def kit_tests(quick: bool) -> list[tuple[str, Callable[..., None], dict[str, Any]]]:
    """``EngineConformance``'s tests as ``(label, function, arguments)``, in the order the kit defines them, each
    parametrized one expanded (as pytest names them)."""
    import inspect

    from weightsync.api.testing import EngineConformance

    tests: list[tuple[str, Callable[..., None], dict[str, Any]]] = []
    for name, function in vars(EngineConformance).items():
        if not name.startswith("test_") or not callable(function):
            continue
        marks = [mark for mark in getattr(function, "pytestmark", []) if mark.name == "parametrize"]
        parameters = list(inspect.signature(function).parameters)[2:]  # after self and harness
        if len(marks) > 1 or (marks and "," in str(marks[0].args[0])):
            raise RuntimeError(f"{name}: gpu-check runs one parametrize argument per kit test")
        arguments = [str(marks[0].args[0])] if marks else []
        if parameters != arguments:
            raise RuntimeError(f"{name} takes {parameters}: gpu-check gives a kit test the harness and its "
                               "parametrized argument only")
        if marks:
            tests += [(f"{name}[{value}]", function, {arguments[0]: value}) for value in marks[0].args[1]]
        else:
            tests.append((name, function, {}))
    if quick:
        tests = [test for test in tests if test[0] not in QUICK_LEAVES_OUT]
    return tests


def check_conformance(ctx: Context, name: str, backend: str, options: dict[str, Any], placement: str,
                      receivers: int, kit_device: str) -> Result:
    from weightsync.api.testing import EngineConformance, EngineHarness, WorkerFailed

    tests = kit_tests(ctx.args.quick)
    harness = EngineHarness(backend, receivers=receivers, bucket_bytes=KIT_BUCKET_BYTES, options=options,
                            timeout=60.0, device=kit_device, placement=placement)
    instance = EngineConformance()
    failures: list[str] = []
    passed = 0
    try:
        harness.start()
        harness.setup()
        for index, (label, function, arguments) in enumerate(tests):
            try:
                function(instance, harness, **arguments)
                passed += 1
            except Exception as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                failures.append(f"{label}: {type(exc).__name__}: {first[:300]}")
                if isinstance(exc, TimeoutError) or (isinstance(exc, WorkerFailed) and
                                                     exc.error_type == "ProcessDied"):
                    failures.append(f"{len(tests) - index - 1} tests not run after that")
                    break
    finally:
        harness.close()
    where = f"receivers={receivers}, placement={placement}" + (f", options={options}" if options else "")
    return Result(name, "failed" if failures else "ok", figures={"tests": float(passed),
                                                                  "failed": float(len(tests) - passed)},
                  note="; ".join(failures) if failures else f"{passed} kit tests passed ({where})")


def nccl_worker_device() -> str:
    """The kit's ``device`` for the nccl line (``gpu_check:nccl_worker_device``): each worker on a GPU of its own
    (the sender on GPU 0, receivers on the others; NCCL refuses two ranks on one GPU)."""
    import multiprocessing

    import torch

    name = multiprocessing.current_process().name  # the harness names them "... actor rank 0", "... rollout rank 1"
    rank = int(name.rsplit(" ", 1)[-1]) if name.rsplit(" ", 1)[-1].isdigit() else 0
    index = 0 if "actor" in name else 1 + rank % max(1, torch.cuda.device_count() - 1)
    torch.cuda.set_device(index)
    return "cuda"


# -- the plan ---------------------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    run: Callable[[Context], Result] | None
    budget: float
    skip: str = ""
    """Why it is skipped here (short); the check does not run."""
    detail: str = ""


def backend_skip(backend: str) -> tuple[str, str]:
    """("", "") when ``backend`` can run here, else a short reason and the registry's full one."""
    from weightsync.api.errors import UnknownBackendError
    from weightsync.api.registry import get_backend_spec

    try:
        spec = get_backend_spec(backend)
    except UnknownBackendError as exc:
        return "not installed", str(exc)
    try:
        reason = spec.probe()
    except Exception as exc:  # a probe must not take the check down
        reason = f"its probe raised {exc!r}"
    return ("unusable here", reason) if reason is not None else ("", "")


def plan(ctx: Context) -> list[Check]:
    args, torch = ctx.args, ctx.torch
    measure = args.check_budget or MEASURE_BUDGET_S
    conformance = args.check_budget or CONFORMANCE_BUDGET_S
    checks = [Check("buckets", check_buckets, measure), Check("copy", check_copy, measure),
              Check("legs", check_legs, measure), Check("staging", check_staging, measure),
              Check("overlap", check_overlap, measure)]
    checks.append(Check("ipc", None, 0, skip="needs CUDA") if ctx.emulated
                  else Check("ipc", check_ipc, args.check_budget or IPC_BUDGET_S))
    placements = ("mixed",) if args.quick else ("device", "mixed")
    receivers = 1 if args.quick else 2
    have_checkout = CHECKOUT_TESTS.exists()

    def line(name: str, backend: str, options: dict[str, Any], placement: str, *, receivers: int = receivers,
             kit_device: str = ctx.kit_device, skip: str = "", detail: str = "") -> None:
        if not skip:
            skip, detail = backend_skip(backend)

        def run(ctx: Context) -> Result:
            return check_conformance(ctx, name, backend, options, placement, receivers, kit_device)

        checks.append(Check(name, run, conformance, skip=skip, detail=detail))

    for backend in HOST_RING_BACKENDS:
        for placement in placements:
            line(f"{backend}/{placement}", backend, {}, placement)
    for backend in DEVICE_RING_BACKENDS:
        for placement in placements:
            line(f"{backend}/cuda-ring/{placement}", backend, {"device": "cuda"}, placement,
                 skip="needs CUDA" if ctx.emulated else "")
    for placement in placements:
        line(f"accel-gloo/{placement}", ACCEL_GLOO, {}, placement,
             skip="" if have_checkout else "needs the repository checkout",
             detail="" if have_checkout else f"{CHECKOUT_TESTS} is not here")
    count = 0 if ctx.emulated else torch.cuda.device_count()
    nccl_skip = ("--skip-nccl" if args.skip_nccl else "needs CUDA" if ctx.emulated
                 else f"needs 2 GPUs ({count} visible)" if count < 2 else "")
    line("nccl/device", "nccl", {}, "device", receivers=1, kit_device="gpu_check:nccl_worker_device", skip=nccl_skip,
         detail="the NCCL conformance suite needs two GPUs: sender and receiver on separate devices"
         if count < 2 and not ctx.emulated else "")
    return checks


# -- the child that runs the checks -----------------------------------------------------------------------------------


def run_checks(args: argparse.Namespace) -> int:
    """Run the checks, reporting to ``args.run_checks`` one JSON line per event: the device, the plan, each
    check's start and its result. The parent enforces the budgets and kills this process when one runs out."""
    def report(**record: Any) -> None:
        with open(args.run_checks, "a") as progress:  # a whole line per write: the parent reads lines
            progress.write(json.dumps(record) + "\n")

    _die_with_parent()
    import torch

    device, why_not = resolve_device(torch, args.device)
    if device is None:
        report(unavailable=why_not)
        return EXIT_NO_DEVICE
    emulated = device.type != "cuda"
    if emulated:
        kit_device = "tests.devices:emulated_device" if CHECKOUT_TESTS.exists() else "weightsync.emuaccel:install"
        describe = (f"the emulated accelerator '{device.type}' (weightsync.emuaccel), torch {torch.__version__}, "
                    f"bucket {args.bucket_mib} MiB; its figures exercise the code, they are not a device's")
    else:
        kit_device = "cuda"
        describe = (f"{torch.cuda.get_device_name(device)} ({torch.cuda.device_count()} visible), torch "
                    f"{torch.__version__}, CUDA {torch.version.cuda}, bucket {args.bucket_mib} MiB")
    ctx = Context(torch=torch, device=device, args=args, kit_device=kit_device)
    checks = plan(ctx)
    names = [check.name for check in checks]
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in names and name != "hang"]
        if unknown:
            report(error=f"unknown check names in --only: {', '.join(unknown)}; the checks here: {', '.join(names)}")
            return EXIT_BAD_ARGS
        checks = [Check("hang", check_hang, args.check_budget or MEASURE_BUDGET_S) if name == "hang"
                  else checks[names.index(name)] for name in wanted]
    report(device=device.type, torch=torch.__version__, describe=describe, plan=[check.name for check in checks])
    for check in checks:
        if check.skip or check.run is None:
            report(result=asdict(Result(check.name, "skipped", note=check.detail or check.skip, reason=check.skip)))
            continue
        report(start=check.name, budget=check.budget)
        started = time.perf_counter()
        try:
            result = check.run(ctx)
        except Exception as exc:
            result = Result(check.name, "failed", note=f"{exc!r}\n{traceback.format_exc(limit=4)}")
        result.seconds = time.perf_counter() - started
        report(result=asdict(result))
    return EXIT_OK


def _die_with_parent() -> None:
    """Kill this process group (this child and the harness workers it started) once the parent is gone: a parent
    killed from outside (a test's timeout) must not leave a hung check running."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        if os.getpgid(0) == os.getpid():  # started as the leader of its own group, by the parent
            os.killpg(0, signal.SIGKILL)
        os._exit(EXIT_FAILED)

    threading.Thread(target=watch, name="gpu-check-parent-watch", daemon=True).start()


# -- the parent: budgets, the table, the summary ----------------------------------------------------------------------


def _plugin_dir(workdir: str) -> str:
    """A throwaway dist-info registering the test backend ``test-accel-gloo`` (tests/backends/nccl/accel_gloo.py)
    through the backends' entry point group, for the child and every worker process it spawns."""
    root = pathlib.Path(workdir) / "plugin"
    info = root / "weightsync_gpu_check_accel-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-gpu-check-accel\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        f"[weightsync.backends]\n{ACCEL_GLOO} = tests.backends.nccl.accel_gloo:SPEC\n")
    return str(root)


class Runner:
    """Starts the child with the checks still to run, watches its reports, and kills it (its whole process group:
    harness workers included) when a check or the whole run is out of time."""

    def __init__(self, args: argparse.Namespace, argv: list[str], deadline: float, workdir: str) -> None:
        self.args, self.argv, self.deadline, self.workdir = args, argv, deadline, workdir
        self.results: list[Result] = []
        self.plan: list[str] | None = None
        self.device = self.torch = self.describe = ""
        self.unavailable = self.error = ""
        self.stopped = ""
        """Why the checks still planned were not run (the budget ran out, the child failed between checks)."""
        self.env = dict(os.environ)
        paths = [str(REPO), _plugin_dir(workdir), str(pathlib.Path(__file__).resolve().parent)]
        self.env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH", "")] if p])
        if args.device == "emu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""  # the engines take the process's one accelerator: emu, not CUDA

    def run(self) -> None:
        launches = 0
        while True:
            remaining = None
            if self.plan is not None:
                done = {result.check for result in self.results}
                remaining = [name for name in self.plan if name not in done]
                if not remaining:
                    return
            launches += 1
            if not self._launch(remaining, launches) or self.plan is None:
                return

    def _launch(self, only: list[str] | None, launch: int) -> bool:
        """One child; False when nothing more can be run (it could not start, or time is out)."""
        progress = pathlib.Path(self.workdir) / f"progress-{launch}.jsonl"
        log_path = pathlib.Path(self.workdir) / f"child-{launch}.log"
        argv = list(self.argv)
        if only is not None:
            argv = _without_only(argv) + ["--only", ",".join(only)]
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--run-checks", str(progress)]
        now = time.monotonic()
        phase_end, current, current_budget = min(now + STARTUP_BUDGET_S, self.deadline), None, 0.0
        with open(log_path, "w") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        offset = 0
        try:
            while True:
                exited = child.poll() is not None
                text = progress.read_text() if progress.exists() else ""
                lines = text[offset:].split("\n")
                offset = len(text) - len(lines[-1])  # a line still being written waits for its newline
                for line in lines[:-1]:
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if "start" in record:
                        current, current_budget = record["start"], float(record["budget"])
                        phase_end = min(time.monotonic() + current_budget, self.deadline)
                        print(f"  ...      {current}", flush=True)
                    elif "result" in record:
                        result = Result(**record["result"])
                        self._add(result)
                        current, phase_end = None, min(time.monotonic() + MEASURE_BUDGET_S, self.deadline)
                    elif "plan" in record:
                        self.plan = self.plan or record["plan"]
                        self.device, self.torch, self.describe = record["device"], record["torch"], record["describe"]
                        if launch == 1:
                            print(f"gpu-check on {self.describe}", flush=True)
                        phase_end = min(time.monotonic() + MEASURE_BUDGET_S, self.deadline)
                    elif "unavailable" in record:
                        self.unavailable = record["unavailable"]
                    elif "error" in record:
                        self.error = record["error"]
                if exited:
                    break
                if time.monotonic() > phase_end:
                    self._kill(child)
                    out_of_time = time.monotonic() > self.deadline
                    what = (f"stopped: the whole run's budget of {self.args.budget:.0f} s ran out" if out_of_time
                            else f"did not finish within its budget of {current_budget:.0f} s (killed)")
                    if current is not None:
                        self._add(Result(current, "failed", current_budget, note=what))
                    elif self.plan is None:
                        self.error = f"the check process did not start within {STARTUP_BUDGET_S:.0f} s"
                    if out_of_time:
                        self.stopped = f"not run: the whole run's budget of {self.args.budget:.0f} s ran out"
                    return not out_of_time
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                self._kill(child)
        if current is not None:  # the child died in a check: that check failed, the others go on in a new child
            self._add(Result(current, "failed", note=f"the check process died (exit code {child.returncode}):\n"
                                                    + _tail(log_path)))
            return True
        if self.plan is None and not (self.unavailable or self.error):
            self.error = f"the check process exited ({child.returncode}) before it ran a check:\n{_tail(log_path)}"
        elif child.returncode != 0:
            self.stopped = f"not run: the check process exited ({child.returncode}) between checks:\n{_tail(log_path)}"
        return False

    def _add(self, result: Result) -> None:
        self.results.append(result)
        print(f"  {result.status:<8} {result.check:<26} {result.seconds:6.1f} s  "
              f"{(result.reason or result.note).splitlines()[0][:100] if (result.reason or result.note) else ''}",
              flush=True)

    @staticmethod
    def _kill(child: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait(30)


def _without_only(argv: list[str]) -> list[str]:
    kept, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
        elif arg == "--only":
            skip_next = True
        elif not arg.startswith("--only="):
            kept.append(arg)
    return kept


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def summary(device: str, results: list[Result], seconds: float) -> str:
    count = {status: [r for r in results if r.status == status] for status in ("ok", "failed", "skipped")}
    failed = f" ({', '.join(r.check for r in count['failed'])})" if count["failed"] else ""
    skipped = (f" ({', '.join(f'{r.check}: {r.reason or r.note}' for r in count['skipped'])})"
               if count["skipped"] else "")
    return (f"gpu-check: device={device or '?'} ok={len(count['ok'])} failed={len(count['failed'])}{failed} "
            f"skipped={len(count['skipped'])}{skipped} in {seconds:.0f} s")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.run_checks:
        return run_checks(args)
    started = time.monotonic()
    missing = missing_modules()
    if missing:
        print(f"gpu-check: missing here: {', '.join(missing)}; see the top of this script for what to carry and how "
              "to install it", file=sys.stderr)
        return EXIT_NO_WHEELS
    if args.dry_run:
        for module in ("torch", "weightsync.api.testing", "weightsync.core.staging", "weightsync.core.unpack"):
            try:
                importlib.import_module(module)
            except ImportError as exc:
                print(f"gpu-check: {module} does not import: {exc}", file=sys.stderr)
                return EXIT_NO_WHEELS
        torch = sys.modules["torch"]
        print(f"gpu-check: dry run: imports fine (torch {torch.__version__}), device {args.device}, bucket "
              f"{args.bucket_mib} MiB, {args.slots} slots, {args.repeats} repeats")
        return EXIT_OK
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        runner = Runner(args, argv, started + args.budget, workdir)
        runner.run()
    if runner.unavailable:
        print(f"gpu-check: {runner.unavailable}", file=sys.stderr)
        return EXIT_NO_DEVICE
    if runner.error and runner.plan is None:
        print(f"gpu-check: {runner.error}", file=sys.stderr)
        return EXIT_BAD_ARGS if runner.error.startswith("unknown check names") else EXIT_FAILED
    results = runner.results
    if runner.plan is not None:  # what the budget left unrun
        done = {result.check for result in results}
        results += [Result(name, "failed", note=runner.stopped or "not run") for name in runner.plan
                    if name not in done]
    print(f"\n{'check':<26} {'status':<8} figures")
    for result in results:
        figures = ", ".join(f"{key}={value:.3g}" for key, value in result.figures.items())
        print(f"{result.check:<26} {result.status:<8} {figures}")
        if result.note:
            print("\n".join(f"{'':<35}{line}" for line in result.note.splitlines()))
    seconds = time.monotonic() - started
    line = summary(runner.device, results, seconds)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": runner.device, "torch": runner.torch, "seconds": seconds, "summary": line,
                       "results": [asdict(result) for result in results]}, handle, indent=2)
    print(line, flush=True)
    return EXIT_FAILED if any(result.status == "failed" for result in results) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
