"""gpu-check's shared pieces (``tools/gpu-check/gpu_check.py`` is the script): the checks' budgets and names, a
check's result, the context every check gets, a planned check, and the device to run on.

A sibling module of ``gpu_check.py``, imported by plain name: the script's folder is ``sys.path[0]`` when it runs,
and on the ``PYTHONPATH`` of the child that runs the checks (and of every process that child spawns).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[2]
"""The repository checkout this script lives in (tools/gpu-check/gpucheck_kit.py)."""
CHECKOUT_TESTS = REPO / "tests" / "backends" / "nccl" / "accel_gloo.py"

MEASURE_BUDGET_S, IPC_BUDGET_S, CONFORMANCE_BUDGET_S = 60.0, 90.0, 150.0
"""Each check's own budget, unless ``--check-budget`` says otherwise."""

HOST_RING_BACKENDS = ("shm", "gloo", "tcp", "nixl", "mooncake")
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


# -- a planned check --------------------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    run: Callable[[Context], Result] | None
    budget: float
    skip: str = ""
    """Why it is skipped here (short); the check does not run."""
    detail: str = ""
