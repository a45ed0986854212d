"""Backends the tests define, made visible to the processes the tests spawn."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from weightsync.api.registry import BackendSpec, register_backend


@contextlib.contextmanager
def backends_on_path(root: Path, specs: Mapping[str, str]) -> Iterator[None]:
    """Register each ``name -> "module:SPEC"`` of ``specs`` in this process and, through a throwaway dist-info under
    ``root``, in spawned workers (they start from the parent's sys.path, which multiprocessing sends, not from
    PYTHONPATH)."""
    info = root / "weightsync_test_backends-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: weightsync-test-backends\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[weightsync.backends]\n" + "".join(f"{name} = {target}\n" for name, target in specs.items()))
    for target in specs.values():
        module, _, attribute = target.partition(":")
        spec = getattr(importlib.import_module(module), attribute)
        assert isinstance(spec, BackendSpec)
        register_backend(spec)
    sys.path.append(str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
