"""Compiling ``_stream_copy.c`` into the plain shared library that ``weightsync.core.native`` loads with ctypes.

Standard library only: the build hook (``hatch_build.py``) loads this file by its path inside pip's build
environment, where neither torch nor weightsync is installed. It is called from two places:

- the build hook, at install: the library goes beside the module, into the wheel or, for an editable install, into
  the source tree;
- ``native``, at import, when no usable library lies beside the module. That happens to editable installs whose
  tree changed after their environment was made (a ``git clean``, a fresh clone at the same path, a pull that
  changed the C source): the environment is not reinstalled, so the hook does not run again. The library is then
  built once per source, flags and compiler, into a per-user cache:

      $WEIGHTSYNC_CACHE_DIR, else $XDG_CACHE_HOME/weightsync, else ~/.cache/weightsync
          _stream_copy-<hash>.so.1        the library, renamed into place only once complete
          _stream_copy-<hash>.lock        an ``flock`` held by the one process that builds (Ray workers and test
                                          workers start together); the others wait, then load its library
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

FLAGS = ("-O2", "-shared", "-fPIC")
COMPILE_TIMEOUT_S = 120.0
LOCK_TIMEOUT_S = 2 * COMPILE_TIMEOUT_S
"""A builder holds the lock for one compile at most (its timeout), and the kernel drops the lock if it dies."""
NO_COMPILER = "no C compiler found (install gcc, or set CC)"


def compiler() -> list[str] | None:
    """``$CC`` (split like a shell would), else the first of cc, gcc and clang on PATH; None if there is none."""
    try:
        explicit = shlex.split(os.environ.get("CC", ""))
    except ValueError:  # unbalanced quotes: taken as one path, which then fails to run with a reason
        explicit = [os.environ["CC"]]
    if explicit:
        return explicit
    found = [path for path in (shutil.which(name) for name in ("cc", "gcc", "clang")) if path]
    return found[:1] or None


def compile_library(source: Path, library: Path) -> str:
    """Compile ``source`` into the shared library ``library``: "" once it is there, else why not."""
    if not sys.platform.startswith("linux"):
        return f"the helper is built on Linux only (this is {sys.platform})"
    command = compiler()
    if command is None:
        return NO_COMPILER
    try:
        subprocess.run([*command, *FLAGS, "-o", str(library), str(source)], check=True, capture_output=True,
                       text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        return f"compiling {source.name} with {command[0]} failed: {exc.stderr.strip()[-400:]}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"compiling {source.name} with {command[0]} failed: {exc}"
    return ""


def cache_dir() -> Path:
    """Where libraries built at first use are kept (see the module docstring)."""
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("WEIGHTSYNC_CACHE_DIR") or user_cache / "weightsync")


def cached_library(source: Path) -> tuple[Path | None, str]:
    """The library built from ``source`` in the cache, compiled first (once, under a lock) if it is not there yet;
    or None and why not."""
    command = compiler()
    if command is None:
        return None, NO_COMPILER
    try:  # called at import: whatever goes wrong is a reason, never an exception
        digest = hashlib.sha256(source.read_bytes())
        digest.update("\0".join([*FLAGS, *command]).encode())
        directory = cache_dir()
        stem = f"{source.stem}-{digest.hexdigest()[:16]}"
        library = directory / f"{stem}.so.1"
        if library.exists():
            return library, ""
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / f"{stem}.lock", "a+") as lock:  # closing the file releases the lock
            if not _acquire(lock.fileno()):
                return None, f"another process has been building {library} for over {LOCK_TIMEOUT_S:.0f} s"
            if library.exists():  # built by the process we waited for
                return library, ""
            partial = directory / f"{stem}.{os.getpid()}.partial"
            why = compile_library(source, partial)
            if why:
                partial.unlink(missing_ok=True)
                return None, why
            os.replace(partial, library)
    except (OSError, RuntimeError) as exc:  # RuntimeError: Path.home() without a home
        return None, f"cannot build it in the cache: {exc}"
    return library, ""


def _acquire(fd: int) -> bool:
    """Take the build lock, waiting at most LOCK_TIMEOUT_S for a process building now: True once held."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
