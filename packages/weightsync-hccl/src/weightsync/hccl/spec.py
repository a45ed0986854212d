"""Registry data for the ``hccl`` backend (Ascend NPUs through torch_npu), and the checks its probe runs.

``torch_npu`` is looked up with ``find_spec`` first, so a machine without it gets the install hint, not an
ImportError; only when it is installed does the probe import it (which also needs Ascend CANN's libraries).
"""

from __future__ import annotations

import importlib

from weightsync.api.registry import BackendSpec, module_importable

__all__ = ["SPEC", "npu_reason", "probe", "TORCH_NPU_HINT"]

TORCH_NPU_HINT = (
    "install Ascend CANN and the torch_npu wheel matching this torch (pip install torch-npu==<torch version>), "
    "then source CANN's set_env.sh"
)


def npu_reason() -> str | None:
    """``None`` when this process can run HCCL on an Ascend NPU, else what is missing and how to fix it."""
    missing = module_importable("torch", "msgspec")
    if missing is not None:
        return missing
    if module_importable("torch_npu") is not None:
        return f"Python module 'torch_npu' is not installed: {TORCH_NPU_HINT}"
    try:
        import torch

        # Imported by name so type checkers need no torch_npu stubs; importing it registers torch.npu.
        importlib.import_module("torch_npu")
    except Exception as exc:  # CANN libraries missing or mismatched: torch_npu raises various errors on import
        return f"torch_npu is installed but failed to import ({exc}); {TORCH_NPU_HINT}"
    npu = getattr(torch, "npu", None)
    try:
        if npu is None or not npu.is_available() or npu.device_count() < 1:
            return "no Ascend NPU is visible to this process (check npu-smi and ASCEND_RT_VISIBLE_DEVICES)"
    except Exception as exc:
        return f"the Ascend runtime failed to initialise: {exc}"
    return None


def probe() -> str | None:
    return npu_reason()


SPEC = BackendSpec(name="hccl", engine="weightsync.hccl.engine:HcclCheckpointEngine",
                   distribution="weightsync-hccl", devices=frozenset({"npu"}), cross_node=True, probe=probe,
                   description="HCCL broadcast of Ascend NPU device buckets in a private process group (torch_npu); "
                               "crosses nodes")
