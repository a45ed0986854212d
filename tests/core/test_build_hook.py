"""weightsync-core's wheel: pure Python (``py3-none-any``, which a package index accepts on every platform) with the
helper's C source in it, never a library built on the machine that made the wheel; installed, ``weightsync.core.native``
builds the helper from that source at first use (tools/wheel-check checks that in a venv of the wheels). Built from a
copy of the package, as pip builds it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

CORE = pathlib.Path(__file__).resolve().parents[2] / "packages" / "weightsync-core"
NATIVE = "weightsync/core/native/"


def build_wheel(tmp_path: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
    source = tmp_path / "weightsync-core"
    shutil.copytree(CORE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "dist"))
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], env=env, check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    return wheel


def test_the_wheel_is_pure_and_carries_the_helpers_source(tmp_path: pathlib.Path) -> None:
    """Even from a tree that holds a built library (an editable checkout's), and with a compiler at hand."""
    (tmp_path / "tree").mkdir()
    library = CORE / "src" / NATIVE / "_stream_copy.so.1"
    wheel = build_wheel(tmp_path / "tree", dict(os.environ))
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert f"{NATIVE}_stream_copy.c" in names and f"{NATIVE}build.py" in names
    assert not [name for name in names if name.startswith(NATIVE) and ".so" in name], names
    assert library.exists() or shutil.which("cc") is None  # the copy built from did hold one (negative control)
