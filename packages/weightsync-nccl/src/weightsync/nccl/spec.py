"""Registry data for the ``nccl`` backend, and the CUDA checks its probe runs.

On a machine without an NVIDIA driver the probe answers without importing anything heavy (``available_backends()``
stays cheap); where a driver exists it imports torch to ask the CUDA runtime, never ``weightsync.nccl.engine``. Each
reason it returns says what to change, because ``weightsync doctor`` prints it as is.
"""

from __future__ import annotations

from weightsync.api.registry import BackendSpec, module_importable, nvidia_driver_present

__all__ = ["SPEC", "cuda_reason", "probe"]


def cuda_reason() -> str | None:
    """``None`` when this process can run NCCL on a CUDA device, else what is missing and how to fix it."""
    missing = module_importable("torch", "msgspec")
    if missing is not None:
        return missing
    if not nvidia_driver_present():
        return ("no NVIDIA driver on this machine (no /dev/nvidiactl, /proc/driver/nvidia or libcuda): run on a host "
                "with NVIDIA GPUs and their driver, with a CUDA build of torch")
    import torch
    import torch.distributed

    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a build without CUDA; install a CUDA build of torch "
                "(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128)")
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return f"this torch ({torch.__version__}) was built without NCCL support"
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return ("no CUDA device is visible to this process (check the NVIDIA driver with nvidia-smi, and "
                    "CUDA_VISIBLE_DEVICES / the Ray worker's num_gpus)")
    except Exception as exc:  # a mismatched driver raises from the CUDA runtime on some builds
        return f"the CUDA runtime failed to initialise: {exc}"
    return None


def probe() -> str | None:
    return cuda_reason()


SPEC = BackendSpec(name="nccl", engine="weightsync.nccl.engine:NcclCheckpointEngine",
                   distribution="weightsync-nccl", devices=frozenset({"cuda"}), cross_node=True, probe=probe,
                   description="NCCL broadcast of CUDA device buckets in a private process group; copy/comm streams; "
                               "crosses nodes")
