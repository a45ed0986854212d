"""Compile the emulator's C++ source on first use, once per user, torch version and Python, and load it.

Why at first use and not when the distribution is installed: the library is built against the torch that is
installed *then* (its headers and ABI), so the distribution needs no torch at build time and installs under pip's
build isolation. The compiled library lives in a per-user cache, never under the working directory:

    $WEIGHTSYNC_EMU_CACHE_DIR, else $XDG_CACHE_HOME/weightsync-emuaccel, else ~/.cache/weightsync-emuaccel
        <torch version>-<python tag>-<source hash>/      torch's cpp_extension build directory
            weightsync_emuaccel.so                       the library
            built.ok                                     written after a successful build
        <same name>.lock                                 our build lock

Concurrent first uses (xdist workers, Ray actors, spawned processes) serialise on an ``fcntl.flock`` lock, which the
kernel releases when its holder dies; a process that finds ``built.ok`` loads the library without taking it. torch's
own lock (a ``lock`` file in the build directory, its ``FileBaton``) is only removed by the process that made it, so
one left by a killed build would make every later build wait forever: under our lock no other build can be running,
so a baton found there is stale and is removed before building.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

LIBRARY_NAME = "weightsync_emuaccel"
SOURCES = ("csrc/streams.cpp", "csrc/guard.cpp", "csrc/memory.cpp", "csrc/ops.cpp")
HEADERS = ("csrc/emu.h",)
CFLAGS = ("-O2", "-fvisibility=hidden")
BUILD_LOCK_TIMEOUT_S = 900.0
PACKAGE_DIR = Path(__file__).resolve().parent


class EmuError(RuntimeError):
    """The emulator cannot be installed in this process (another PrivateUse1 backend owns it) or was misconfigured."""


class EmuBuildError(EmuError):
    """The emulator's C++ library could not be compiled or loaded (the message says where and why)."""


def cache_root() -> Path:
    """Where compiled libraries are cached (see the module docstring)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("WEIGHTSYNC_EMU_CACHE_DIR") or user_cache / "weightsync-emuaccel")


def source_digest() -> str:
    """A short hash of the sources and flags: a changed source gets a build directory of its own."""
    digest = hashlib.sha256()
    for relative in (*SOURCES, *HEADERS):
        digest.update(relative.encode())
        digest.update((PACKAGE_DIR / relative).read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    """The build directory for this torch, this Python and these sources."""
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"{torch.__version__}-{python_tag}-{source_digest()}"


def ensure_built() -> Path:
    """The compiled library, compiling it first if no finished build is cached; nothing is loaded."""
    directory = build_dir()
    if not (directory / "built.ok").exists():
        _build_locked(directory)
    return directory / f"{LIBRARY_NAME}.so"


def load_library() -> Path:
    """Load the compiled library into this process, compiling it first if no finished build is cached."""
    library = ensure_built()
    # torch.ops.load_library is unannotated; called through a typed alias (mypy strict).
    load: Callable[[str], None] = torch.ops.load_library
    load(str(library))
    return library


def _build_locked(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory.parent / f"{directory.name}.lock"
    with open(lock_path, "a+") as lock_file:
        _acquire(lock_file.fileno(), lock_path)
        try:
            if (directory / "built.ok").exists():
                return  # another process built it while we waited
            stale_baton = directory / "lock"
            if stale_baton.exists():
                stale_baton.unlink()
            _compile(directory)
            (directory / "built.ok").write_text(f"{torch.__version__}\n")
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _acquire(fd: int, lock_path: Path) -> None:
    """Take the build lock, waiting for a live builder (at most BUILD_LOCK_TIMEOUT_S: a build takes about a minute)."""
    deadline = time.monotonic() + BUILD_LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            raise EmuBuildError(
                f"emu: another process has held the build lock {lock_path} for over {BUILD_LOCK_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.1)


def _compile(directory: Path) -> None:
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise EmuBuildError("emu: no C++ compiler found (install g++, or set CXX) to build the emulated accelerator")
    try:
        cpp_extension.load(
            name=LIBRARY_NAME,
            sources=[str(PACKAGE_DIR / source) for source in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(directory),
            is_python_module=False,
            verbose=bool(os.environ.get("WEIGHTSYNC_EMU_BUILD_VERBOSE")),
        )
    except Exception as error:
        raise EmuBuildError(f"emu: building the emulated accelerator in {directory} failed: {error}") from error


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel's binary is not on it when the environment is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError as error:
        raise EmuBuildError("emu: ninja is needed to build the emulated accelerator (pip install ninja)") from error
    os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), os.environ.get("PATH", "")])
