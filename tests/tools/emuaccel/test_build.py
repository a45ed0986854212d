"""The first-use build: where it is cached, that a killed build cannot hang the next one, what the wheel ships."""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
import tomllib
import zipfile

import pytest
import torch

from tests.tools.emuaccel.processes import run_python
from weightsync.emuaccel import _build

DISTRIBUTION = pathlib.Path(__file__).resolve().parents[3] / "tools" / "weightsync-emuaccel"


def test_the_cache_is_per_user_torch_and_python_never_the_working_directory(
        emu: str, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    directory = _build.build_dir()
    assert directory.name.startswith(f"{torch.__version__}-cp{sys.version_info.major}{sys.version_info.minor}-")
    assert (directory / "built.ok").exists() and (directory / f"{_build.LIBRARY_NAME}.so").exists()
    assert not directory.is_relative_to(pathlib.Path.cwd())
    monkeypatch.delenv("WEIGHTSYNC_EMU_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_root() == tmp_path / "xdg" / "weightsync-emuaccel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _build.cache_root() == tmp_path / "home" / ".cache" / "weightsync-emuaccel"
    monkeypatch.setenv("WEIGHTSYNC_EMU_CACHE_DIR", str(tmp_path / "explicit"))
    assert _build.build_dir().parent == tmp_path / "explicit"


def _interrupted_build(emu: str, cache: pathlib.Path) -> pathlib.Path:
    """A copy of this machine's finished build in ``cache`` (so nothing recompiles), left as a build that was
    killed: no ``built.ok``, torch's baton still there, our lock taken by a process that then died."""
    finished = _build.build_dir()
    interrupted = cache / finished.name
    shutil.copytree(finished, interrupted)
    (interrupted / "built.ok").unlink()
    (interrupted / "lock").touch()
    lock_path = cache / f"{finished.name}.lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, signal
        handle = open({str(lock_path)!r}, "a+")
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        os.kill(os.getpid(), signal.SIGKILL)
    """)])
    assert holder.wait(60) == -signal.SIGKILL
    return interrupted


def test_a_killed_build_does_not_hang_the_next_install(emu: str, tmp_path: pathlib.Path) -> None:
    interrupted = _interrupted_build(emu, tmp_path)
    with open(tmp_path / f"{interrupted.name}.lock") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel released the dead holder's lock
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    result = run_python("""
        import torch
        from weightsync.emuaccel import install
        print(torch.ones(2).to(install()).cpu().tolist())
    """, timeout=300, env={"WEIGHTSYNC_EMU_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[1.0, 1.0]"
    assert (interrupted / "built.ok").exists() and not (interrupted / "lock").exists()


def test_negative_control_torchs_own_loader_waits_forever_on_that_baton(emu: str, tmp_path: pathlib.Path) -> None:
    interrupted = _interrupted_build(emu, tmp_path)
    sources = [str(_build.PACKAGE_DIR / source) for source in _build.SOURCES]
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(f"""
            from torch.utils import cpp_extension
            cpp_extension.load({_build.LIBRARY_NAME!r}, {sources!r}, extra_cflags={list(_build.CFLAGS)!r},
                               build_directory={str(interrupted)!r}, is_python_module=False)
        """, timeout=10)


def test_the_wheel_ships_the_sources_and_nothing_compiled(tmp_path: pathlib.Path) -> None:
    pyproject = tomllib.loads((DISTRIBUTION / "pyproject.toml").read_text())
    assert not any("torch" in requirement for requirement in pyproject["build-system"]["requires"])
    from hatchling.builders.wheel import WheelBuilder

    wheel = next(iter(WheelBuilder(str(DISTRIBUTION)).build(directory=str(tmp_path), versions=["standard"])))
    names = set(zipfile.ZipFile(wheel).namelist())
    package = "weightsync/emuaccel/"
    shipped = {"__init__.py", "py.typed", "csrc/emu.h", *_build.SOURCES}
    assert {package + name for name in shipped} <= names
    assert "weightsync/__init__.py" not in names
    assert not [name for name in names if name.endswith((".so", ".o"))]
    assert os.path.basename(wheel).startswith("weightsync_emuaccel-")


def test_build_compiles_without_registering_anything() -> None:
    """What the test session runs before starting workers: the library exists afterwards, torch is untouched."""
    done = run_python("""
        import torch
        from weightsync.emuaccel import build
        library = build()
        print(library.exists(), torch.accelerator.current_accelerator(), torch._C._get_privateuse1_backend_name())
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None", "privateuseone"]
