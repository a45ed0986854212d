#!/usr/bin/env python3
"""gpu-check: what one GPU machine tells us about weightsync's device path, in under five minutes.

Runs on a machine with a GPU and no network, with that machine's own (CUDA) torch plus our pure-Python wheels.

What to carry, and how to build it (on a machine with network, from the repository root)::

    python -m pip wheel --no-deps -w gpu-wheels \\
        packages/weightsync-api packages/weightsync-core packages/weightsync-gloo packages/weightsync-nccl
    python -m pip download --no-deps -d gpu-wheels msgspec xxhash typing-extensions   # if the GPU box lacks them
    # carry: gpu-wheels/ and tools/gpu-check/gpu_check.py

On the GPU machine (no network)::

    python -m pip install --no-index --no-deps gpu-wheels/*.whl      # never reinstalls torch
    python gpu_check.py                # or: python gpu_check.py --quick / --json out.json

Checks, each timed and bounded:

1. ``buckets``   — allocate and zero ``--slots`` buckets of ``--bucket-mib`` in device memory (what the engine keeps).
2. ``copy``      — the device's own copy bandwidth (device-to-device ``copy_`` of a bucket), the yardstick.
3. ``legs``      — the pipeline's legs: pack (D2D from scattered parameters into a bucket, on a copy stream), H2D and
   D2H between pinned host memory and a bucket, D2H into pageable memory; each as GB/s and as a fraction of (2).
4. ``overlap``   — copy stream vs a second ("communication") stream: two bucket copies issued on both streams
   concurrently vs one after the other; ratio near 0.5 means they overlap.
5. ``ipc``       — CUDA-IPC hand-off of a device bucket to a second process on the same GPU (``torch.multiprocessing``
   reductions: the mechanism checkpoint-engine's ParameterServer uses): the child maps it, verifies a checksum and
   writes back; reports the hand-off latency.
6. ``nccl``      — the NCCL conformance suite (weightsync.api.testing) over our ``nccl`` backend, only when two or more
   GPUs are visible; otherwise reported as skipped with the reason.

Exit codes: 0 all checks passed (skips allowed), 1 a check failed, 2 bad arguments (argparse), 3 our wheels are
missing, 4 no CUDA device (nothing measured). ``--dry-run`` parses arguments and checks imports only (used by the CPU test suite).
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_NO_WHEELS, EXIT_NO_CUDA = 0, 1, 3, 4
OUR_MODULES = ("weightsync.api", "weightsync.core", "weightsync.gloo", "weightsync.nccl")


@dataclass
class Result:
    check: str
    status: str  # "ok", "failed", "skipped"
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--bucket-mib", type=int, default=256, help="bucket size in MiB (default 256)")
    parser.add_argument("--slots", type=int, default=2, help="buckets per side (default 2)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repetitions per leg (default 10)")
    parser.add_argument("--quick", action="store_true", help="64 MiB buckets, 3 repeats")
    parser.add_argument("--skip-nccl", action="store_true", help="do not run the NCCL conformance suite")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--dry-run", action="store_true", help="parse arguments and check imports, measure nothing")
    args = parser.parse_args(argv)
    if args.bucket_mib < 1 or args.slots < 1 or args.repeats < 1:
        parser.error("--bucket-mib, --slots and --repeats must be positive")
    if args.quick:
        args.bucket_mib, args.repeats = 64, 3
    return args


def missing_modules() -> list[str]:
    missing = []
    for module in OUR_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


# -- measurements -----------------------------------------------------------------------------------------------------


def _timed(torch: Any, function: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``function`` measured with CUDA events (after one warm-up)."""
    function()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    samples.sort()
    return float(samples[len(samples) // 2])


def check_buckets(torch: Any, args: argparse.Namespace) -> Result:
    nbytes = args.bucket_mib << 20
    started = time.perf_counter()
    buckets = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(args.slots)]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    free, total = torch.cuda.mem_get_info()
    del buckets
    return Result("buckets", "ok", seconds, {"alloc_zero_gbps": args.slots * nbytes / seconds / 1e9,
                                             "device_free_gib": free / 2**30, "device_total_gib": total / 2**30})


def check_legs(torch: Any, args: argparse.Namespace) -> list[Result]:
    nbytes = args.bucket_mib << 20
    bucket = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    other = torch.empty_like(bucket)
    d2d = _timed(torch, lambda: other.copy_(bucket), args.repeats)
    yardstick = nbytes / d2d / 1e9
    results = [Result("copy", "ok", d2d * args.repeats, {"d2d_gbps": yardstick})]
    # Pack: many parameter-sized tensors into one bucket on a copy stream (what the engine's pack thread does).
    params = [torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
              for n in _param_sizes(nbytes)]
    copy_stream = torch.cuda.Stream()

    def pack() -> None:
        with torch.cuda.stream(copy_stream):
            offset = 0
            for param in params:
                size = param.numel() * 2
                bucket[offset:offset + size].copy_(param.view(torch.uint8))
                offset += (size + 255) // 256 * 256
        torch.cuda.current_stream().wait_stream(copy_stream)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    figures = {
        "pack_gbps": nbytes / _timed(torch, pack, args.repeats) / 1e9,
        "h2d_pinned_gbps": nbytes / _timed(torch, lambda: bucket.copy_(pinned, non_blocking=True), args.repeats) / 1e9,
        "d2h_pinned_gbps": nbytes / _timed(torch, lambda: pinned.copy_(bucket, non_blocking=True), args.repeats) / 1e9,
        "d2h_pageable_gbps": nbytes / _timed(torch, lambda: pageable.copy_(bucket), max(1, args.repeats // 3)) / 1e9,
    }
    figures.update({f"{key[:-5]}_of_d2d": value / yardstick for key, value in list(figures.items())})
    results.append(Result("legs", "ok", 0.0, figures,
                          note="digest staging uses the d2h_pinned leg; pack is the copy stream's work per bucket"))
    return results


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


def check_overlap(torch: Any, args: argparse.Namespace) -> Result:
    nbytes = args.bucket_mib << 20
    a, b = torch.zeros(nbytes, dtype=torch.uint8, device="cuda"), torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    copy_stream, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def serial() -> None:
        with torch.cuda.stream(copy_stream):
            a.copy_(host_a, non_blocking=True)
            b.copy_(host_b, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)

    def concurrent() -> None:
        # H2D on the copy stream while the "communication" stream moves the other bucket D2H: the two legs the
        # engine overlaps (packing bucket k+1 while bucket k is on the wire).
        with torch.cuda.stream(copy_stream):
            a.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(comm_stream):
            host_b.copy_(b, non_blocking=True)
        torch.cuda.current_stream().wait_stream(copy_stream)
        torch.cuda.current_stream().wait_stream(comm_stream)

    serial_s = _timed(torch, serial, args.repeats)
    concurrent_s = _timed(torch, concurrent, args.repeats)
    return Result("overlap", "ok", serial_s + concurrent_s,
                  {"serial_ms": serial_s * 1e3, "two_streams_ms": concurrent_s * 1e3,
                   "ratio": concurrent_s / serial_s},
                  note="ratio ~0.5: H2D and D2H run concurrently on two streams (copy engines in both directions)")


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


def check_ipc(torch: Any, args: argparse.Namespace) -> Result:
    nbytes = args.bucket_mib << 20
    context = multiprocessing.get_context("spawn")
    queue, answer = context.Queue(), context.Queue()
    child = context.Process(target=_ipc_child, args=(queue, answer), daemon=True)
    child.start()
    try:
        bucket = torch.randint(0, 1000, (nbytes // 8,), dtype=torch.int64, device="cuda").view(torch.uint8)
        expected = int(bucket.view(torch.int64).sum().item())
        torch.cuda.synchronize()
        started = time.perf_counter()
        queue.put((bucket, expected))  # torch's reductions send a CUDA-IPC handle, not the bytes
        status, detail, child_seconds = answer.get(timeout=120)
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


def check_nccl(torch: Any, args: argparse.Namespace) -> Result:
    if args.skip_nccl:
        return Result("nccl", "skipped", note="--skip-nccl")
    if torch.cuda.device_count() < 2:
        return Result("nccl", "skipped", note=f"{torch.cuda.device_count()} GPU visible; the NCCL conformance suite "
                                               "needs two (sender and receiver on separate devices)")
    from weightsync.api.testing import EngineHarness, case_tensors  # noqa: F401  (imported to fail early)

    started = time.perf_counter()
    harness = EngineHarness("nccl", receivers=1, bucket_bytes=1 << 20, timeout=120)
    failures = []
    harness.start()
    try:
        harness.setup()
        for case in ("dtypes", "zero_size", "non_contiguous", "three_buckets", "many_small", "mixed", "partial"):
            try:
                harness.update(case, 1)
            except Exception as exc:
                failures.append(f"{case}: {exc}")
    finally:
        harness.close()
    return Result("nccl", "failed" if failures else "ok", time.perf_counter() - started,
                  note="; ".join(failures) or "7 conformance cases passed")


# -- main -------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_modules()
    if missing:
        print(f"gpu-check: our wheels are not installed ({', '.join(missing)}); see the top of this script for what "
              "to carry and how to install it", file=sys.stderr)
        return EXIT_NO_WHEELS
    try:
        import torch
    except ImportError:
        print("gpu-check: torch is not installed on this machine", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.dry_run:
        print(f"gpu-check: dry run: imports fine (torch {torch.__version__}), bucket {args.bucket_mib} MiB, "
              f"{args.slots} slots, {args.repeats} repeats")
        return EXIT_OK
    if torch.version.cuda is None or not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}, torch.version.cuda="
              f"{torch.version.cuda}); run this on a GPU machine with a CUDA build of torch", file=sys.stderr)
        return EXIT_NO_CUDA
    print(f"gpu-check on {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, bucket {args.bucket_mib} MiB")
    results: list[Result] = []
    checks: list[tuple[str, Callable[[Any, argparse.Namespace], Result | list[Result]]]] = [
        ("buckets", check_buckets), ("legs", check_legs), ("overlap", check_overlap), ("ipc", check_ipc),
        ("nccl", check_nccl),
    ]
    for name, check in checks:
        started = time.perf_counter()
        try:
            outcome = check(torch, args)
            results.extend(outcome if isinstance(outcome, list) else [outcome])
        except Exception as exc:
            results.append(Result(name, "failed", time.perf_counter() - started,
                                  note=f"{exc!r}\n{traceback.format_exc(limit=3)}"))
    print(f"\n{'check':<9} {'status':<8} figures")
    for result in results:
        figures = ", ".join(f"{key}={value:.3g}" for key, value in result.figures.items())
        print(f"{result.check:<9} {result.status:<8} {figures}")
        if result.note:
            print(f"{'':<18}{result.note}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(result) for result in results], handle, indent=2)
    return EXIT_FAILED if any(result.status == "failed" for result in results) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
