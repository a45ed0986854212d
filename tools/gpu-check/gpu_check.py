#!/usr/bin/env python3
"""gpu-check: what one accelerator machine tells us about weightsync's device path, in at most eight minutes.

Runs on a machine with a GPU and no network, with that machine's own (CUDA) torch plus our wheels, from a checkout
of this repository (the conformance step uses ``tests/devices.py`` and the test backend in
``tests/backends/nccl/accel_gloo.py``). Without CUDA it runs on the emulated accelerator (``weightsync.emuaccel``,
device ``emu``): the same code, so CI runs it too (``--device emu --quick``); only what needs CUDA is skipped.

What to carry, and how to build it (on a machine with network, from the repository root)::

    python -m pip wheel --no-deps -w gpu-wheels packages/weightsync-api packages/weightsync-core \\
        packages/weightsync-shm packages/weightsync-gloo packages/weightsync-tcp packages/weightsync-nixl \\
        packages/weightsync-mooncake packages/weightsync-nccl
    python -m pip download --no-deps -d gpu-wheels msgspec xxhash typing-extensions pytest iniconfig pluggy \\
        packaging   # those the GPU machine lacks (the conformance kit imports pytest)
    # carry: gpu-wheels/ and the repository checkout (all of tools/gpu-check/, tests/)

On the GPU machine (no network)::

    python -m pip install --no-index --no-deps gpu-wheels/*.whl      # never reinstalls torch
    python tools/gpu-check/gpu_check.py           # or: --quick, --json out.json, --only bounce,shm/device

A backend whose library is not installed there (nixl, mooncake) is reported as skipped, with the reason.

Checks, in this order, each in a bounded time (``--check-budget``; all of them together at most ``--budget``, 480 s):

1. ``buckets``  — allocate and zero ``--slots`` buckets of ``--bucket-mib`` in device memory (what the engine keeps).
2. ``copy``     — the device's own copy bandwidth (device-to-device ``copy_`` of a bucket), the yardstick.
3. ``legs``     — the pipeline's legs: pack (D2D from scattered parameters into a bucket, on a copy stream), H2D and
   D2H between pinned host memory and a bucket, D2H into pageable memory; each as GB/s and as a fraction of (2).
4. ``bounce``   — weightsync's own host bounce between device tensors and a host bucket: D2H through
   ``weightsync.core.pipeline.bounce.HostBounce.bounce`` (what a sender does for a host transport) and H2D through the
   receiver's unpack (``weightsync.core.pipeline.unpack.BucketReader.copy_out`` into device destinations), each in GB/s and
   as a ratio to a raw pinned ``non_blocking`` copy of the same bytes; the bytes are compared both ways.
5. ``overlap``  — an H2D and a D2H bucket copy one after the other on one stream, then at once on a copy stream and
   a second ("communication") stream; ratio near 0.5 means they overlap.
6. ``ipc``      — CUDA-IPC hand-off of a device bucket to a second process on the same GPU (``torch.multiprocessing``
   reductions: the mechanism checkpoint-engine's ParameterServer uses): the child maps it, verifies a checksum and
   writes back; reports the hand-off latency. CUDA only.
7. conformance — the conformance kit (``weightsync.api.testing``: every test of ``EngineConformance``, run here in
   a loop with one ``EngineHarness`` per line) with sources and destinations on the device, 1 MiB buckets:
   ``shm``, ``gloo``, ``tcp``, ``nixl``, ``mooncake`` through host rings (``<backend>/device``, ``<backend>/mixed``: all
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
from dataclasses import asdict, dataclass
from typing import Any

# Sibling modules, by plain name: this script's folder is sys.path[0] here, and on the child's PYTHONPATH.
from gpucheck_conformance import plan
from gpucheck_kit import (
    ACCEL_GLOO,
    CHECKOUT_TESTS,
    CONFORMANCE_BUDGET_S,
    MEASURE_BUDGET_S,
    REPO,
    Check,
    Context,
    Result,
    resolve_device,
)
from gpucheck_measure import check_hang

EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS, EXIT_NO_WHEELS, EXIT_NO_DEVICE = 0, 1, 2, 3, 4
REQUIRED_MODULES = ("weightsync.api", "weightsync.core", "msgspec", "xxhash", "pytest")
"""What every check needs: our two core wheels, what they import, and pytest (the conformance kit imports it)."""

TOTAL_BUDGET_S = 480.0
"""At most eight minutes in all."""
STARTUP_BUDGET_S = 240.0
"""For the child to import torch and register its device (the emulator's first use on a machine compiles it)."""


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


@dataclass
class _Watch:
    """What the parent knows of its child's progress: the check it is in (with that check's budget), and when the
    current phase (starting up, a check, measuring between checks) runs out."""

    phase_end: float
    current: str | None = None
    budget: float = 0.0


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
        watch = _Watch(phase_end=min(time.monotonic() + STARTUP_BUDGET_S, self.deadline))
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
                    if line.strip():
                        self._follow(json.loads(line), launch, watch)
                if exited:
                    break
                if time.monotonic() > watch.phase_end:
                    self._kill(child)
                    return self._overran(watch)
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                self._kill(child)
        if watch.current is not None:  # the child died in a check: that check failed, the others go on in a new child
            self._add(Result(watch.current, "failed", note=f"the check process died (exit code {child.returncode}):\n"
                                                          + _tail(log_path)))
            return True
        if self.plan is None and not (self.unavailable or self.error):
            self.error = f"the check process exited ({child.returncode}) before it ran a check:\n{_tail(log_path)}"
        elif child.returncode != 0:
            self.stopped = f"not run: the check process exited ({child.returncode}) between checks:\n{_tail(log_path)}"
        return False

    def _follow(self, record: dict[str, Any], launch: int, watch: _Watch) -> None:
        """One line of the child's progress file: a check started or ended, its plan, or why it cannot run."""
        if "start" in record:
            watch.current, watch.budget = record["start"], float(record["budget"])
            watch.phase_end = min(time.monotonic() + watch.budget, self.deadline)
            print(f"  ...      {watch.current}", flush=True)
        elif "result" in record:
            self._add(Result(**record["result"]))
            watch.current, watch.phase_end = None, min(time.monotonic() + MEASURE_BUDGET_S, self.deadline)
        elif "plan" in record:
            self.plan = self.plan or record["plan"]
            self.device, self.torch, self.describe = record["device"], record["torch"], record["describe"]
            if launch == 1:
                print(f"gpu-check on {self.describe}", flush=True)
            watch.phase_end = min(time.monotonic() + MEASURE_BUDGET_S, self.deadline)
        elif "unavailable" in record:
            self.unavailable = record["unavailable"]
        elif "error" in record:
            self.error = record["error"]

    def _overran(self, watch: _Watch) -> bool:
        """The child (killed) ran past its phase: the check it was in failed; False when the whole run is out of
        time."""
        out_of_time = time.monotonic() > self.deadline
        what = (f"stopped: the whole run's budget of {self.args.budget:.0f} s ran out" if out_of_time
                else f"did not finish within its budget of {watch.budget:.0f} s (killed)")
        if watch.current is not None:
            self._add(Result(watch.current, "failed", watch.budget, note=what))
        elif self.plan is None:
            self.error = f"the check process did not start within {STARTUP_BUDGET_S:.0f} s"
        if out_of_time:
            self.stopped = f"not run: the whole run's budget of {self.args.budget:.0f} s ran out"
        return not out_of_time

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
        for module in ("torch", "weightsync.api.testing", "weightsync.core.pipeline.bounce", "weightsync.core.pipeline.unpack"):
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
