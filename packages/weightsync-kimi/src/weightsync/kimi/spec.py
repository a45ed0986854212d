"""Registry data for the ``kimi`` backend (checkpoint-engine's ParameterServer); the probe imports nothing heavy on
a machine without an NVIDIA driver, and torch (to ask for a CUDA device) only where a driver exists."""

from __future__ import annotations

from weightsync.api.registry import BackendSpec, module_importable, nvidia_driver_present

__all__ = ["SPEC", "probe", "CHECKPOINT_ENGINE_HINT", "P2P_HINT"]

CHECKPOINT_ENGINE_HINT = "install MoonshotAI's checkpoint engine: pip install checkpoint-engine==0.4.2"
P2P_HINT = ("mode='p2p' pulls over RDMA through Mooncake: pip install 'weightsync-kimi[p2p]' "
            "(checkpoint-engine[p2p]) on machines with RDMA NICs")


def probe() -> str | None:
    missing = module_importable("torch", "xxhash")
    if missing is not None:
        return missing
    if module_importable("checkpoint_engine", "zmq") is not None:
        return f"Python module 'checkpoint_engine' is not installed: {CHECKPOINT_ENGINE_HINT}"
    if not nvidia_driver_present():
        return ("checkpoint-engine needs a CUDA GPU per worker, and this machine has no NVIDIA driver: run on a host "
                "with NVIDIA GPUs and their driver, with a CUDA build of torch")
    import torch

    if torch.version.cuda is None:
        return (f"checkpoint-engine's ParameterServer moves weights through CUDA (H2D, broadcast, CUDA IPC), and this "
                f"torch ({torch.__version__}) is a build without CUDA; install a CUDA build of torch")
    try:
        if not torch.cuda.is_available():
            return "no CUDA device is visible to this process (check nvidia-smi and CUDA_VISIBLE_DEVICES)"
    except Exception as exc:
        return f"the CUDA runtime failed to initialise: {exc}"
    return None


SPEC = BackendSpec(name="kimi", engine="weightsync.kimi.engine:KimiCheckpointEngine",
                   distribution="weightsync-kimi", devices=frozenset({"cuda"}), cross_node=True, probe=probe,
                   description="MoonshotAI checkpoint-engine ParameterServer: sharded pinned host memory, broadcast "
                               "or P2P (RDMA)")
