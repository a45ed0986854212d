"""weightsync-core's build hook (``hatch_build.py``): the wheel carries the compiled helper where a C compiler exists,
and is pure Python, still installable, where none does. Built from a copy of the package, as pip builds it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

CORE = pathlib.Path(__file__).resolve().parents[2] / "packages" / "weightsync-core"


def build_wheel(tmp_path: pathlib.Path, env: dict[str, str]) -> pathlib.Path:
    source = tmp_path / "weightsync-core"
    shutil.copytree(CORE, source, ignore=shutil.ignore_patterns("*.so.1", "__pycache__", "build", "dist"))
    out = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(source)], env=env, check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.skipif(shutil.which("cc") is None or not sys.platform.startswith("linux"),
                    reason="needs a C compiler on Linux")
def test_with_a_compiler_the_wheel_carries_the_helper(tmp_path: pathlib.Path) -> None:
    wheel = build_wheel(tmp_path, dict(os.environ))
    names = zipfile.ZipFile(wheel).namelist()
    assert "weightsync/core/native/_stream_copy.so.1" in names
    assert wheel.name.endswith(".whl") and "-py3-none-linux_" in wheel.name  # any Python 3, this platform only


def test_without_a_compiler_the_wheel_is_pure_python(tmp_path: pathlib.Path) -> None:
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler")}
    wheel = build_wheel(tmp_path, env)
    names = zipfile.ZipFile(wheel).namelist()
    assert "weightsync/core/native/_stream_copy.so.1" not in names and "weightsync/core/native/__init__.py" in names
    assert wheel.name.endswith("-py3-none-any.whl")
