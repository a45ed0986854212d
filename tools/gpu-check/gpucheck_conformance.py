"""gpu-check's conformance step and its plan (``tools/gpu-check/gpu_check.py`` is the script): the conformance
kit (``weightsync.api.testing.EngineConformance``) run in a loop with one ``EngineHarness`` per line, on the
device, and the plan of every check in the order the script runs them (the measurements, then the lines).

The harness's worker processes (``multiprocessing``, spawn) import ``nccl_worker_device`` from this module by name,
from the script's folder (on their ``sys.path`` and ``PYTHONPATH``, as the child's that runs the checks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpucheck_kit import (
    ACCEL_GLOO,
    CHECKOUT_TESTS,
    CONFORMANCE_BUDGET_S,
    DEVICE_RING_BACKENDS,
    HOST_RING_BACKENDS,
    IPC_BUDGET_S,
    KIT_BUCKET_BYTES,
    MEASURE_BUDGET_S,
    QUICK_LEAVES_OUT,
    Check,
    Context,
    Result,
)
from gpucheck_measure import check_buckets, check_copy, check_ipc, check_legs, check_bounce, check_overlap

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
    import pytest

    from weightsync.api.testing import EngineConformance, EngineHarness, WorkerFailed

    tests = kit_tests(ctx.args.quick)
    harness = EngineHarness(backend, receivers=receivers, bucket_bytes=KIT_BUCKET_BYTES, options=options,
                            timeout=60.0, device=kit_device, placement=placement)
    instance = EngineConformance()
    failures: list[str] = []
    skipped: list[str] = []
    passed = 0
    try:
        harness.start()
        harness.setup()
        for index, (label, function, arguments) in enumerate(tests):
            try:
                function(instance, harness, **arguments)
                passed += 1
            except pytest.skip.Exception as exc:  # a BaseException: the kit says this engine does not take it
                skipped.append(f"{label} skipped: {str(exc.msg).splitlines()[0][:200]}")
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
                                                                  "failed": float(len(tests) - passed - len(skipped))},
                  note="; ".join(failures + skipped) if failures else "; ".join(
                      [f"{passed} kit tests passed ({where})", *skipped]))


def nccl_worker_device() -> str:
    """The kit's ``device`` for the nccl line (``gpucheck_conformance:nccl_worker_device``): each worker on a GPU of
    its own (the sender on GPU 0, receivers on the others; NCCL refuses two ranks on one GPU)."""
    import multiprocessing

    import torch

    name = multiprocessing.current_process().name  # the harness names them "... actor rank 0", "... rollout rank 1"
    rank = int(name.rsplit(" ", 1)[-1]) if name.rsplit(" ", 1)[-1].isdigit() else 0
    index = 0 if "actor" in name else 1 + rank % max(1, torch.cuda.device_count() - 1)
    torch.cuda.set_device(index)
    return "cuda"


# -- the plan ---------------------------------------------------------------------------------------------------------


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
              Check("legs", check_legs, measure), Check("bounce", check_bounce, measure),
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
    line("nccl/device", "nccl", {}, "device", receivers=1, kit_device="gpucheck_conformance:nccl_worker_device",
         skip=nccl_skip, detail="the NCCL conformance suite needs two GPUs: sender and receiver on separate devices"
         if count < 2 and not ctx.emulated else "")
    return checks
