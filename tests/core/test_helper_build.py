"""The compiled helper where the install left none: ``tensors`` builds it from ``_stream_copy.c`` at first use into a
per-user cache (``native.build``), once per source, however many processes start together.

What an editable environment meets when its checkout changes under it (a ``git clean``, a fresh clone at the same
path, as a reused CI machine does): the environment is not reinstalled, so the build hook does not run again.
Checked from outside: a compiler wrapper counts the compiles, the cache folder is listed, and the built library
copies bytes that are compared with the source's.
"""

from __future__ import annotations

import os
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

from weightsync.core import native

from tests.core.test_stream_copy import lands_exactly

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64" and shutil.which("cc")),
    reason="the helper is built only on x86-64 Linux with a C compiler")

SOURCE = pathlib.Path(native.__file__).with_name("_stream_copy.c")


def counting_compiler(tmp_path: pathlib.Path, delay_s: float = 0.0) -> tuple[str, pathlib.Path]:
    """A ``CC`` that appends a line to a log on every call, then runs cc (after ``delay_s``, to widen races)."""
    log = tmp_path / "compiles.log"
    script = tmp_path / "counting-cc"
    script.write_text(f'#!/bin/sh\necho "$$" >> {log}\nsleep {delay_s}\nexec {shutil.which("cc")} "$@"\n')
    script.chmod(0o755)
    return str(script), log


def compiles(log: pathlib.Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_missing_library_is_built_once_per_source(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler, log = counting_compiler(tmp_path)
    monkeypatch.setenv("CC", compiler)
    monkeypatch.setenv("WEIGHTSYNC_CACHE_DIR", str(tmp_path / "cache"))
    library, path, why = native._load_helper(tmp_path / "missing.so.1")
    assert library is not None and path is not None and why == "", why
    assert path.parent == tmp_path / "cache" and compiles(log) == 1
    assert [entry.suffix for entry in sorted((tmp_path / "cache").iterdir())] == [".lock", ".1"]
    for nbytes in (4097, (1 << 20) + 13):
        assert lands_exactly(library.weightsync_stream_copy, nbytes, 5, 3)
    # The next process finds it: nothing is compiled again.
    assert native._load_helper(tmp_path / "missing.so.1")[1] == path and compiles(log) == 1
    # Control: another source (a pull that changed it) gets a library of its own.
    changed = tmp_path / "_stream_copy.c"
    changed.write_text(SOURCE.read_text() + "\n/* changed */\n")
    library, other, why = native._load_helper(tmp_path / "missing.so.1", changed)
    assert library is not None and other not in (None, path) and compiles(log) == 2, why


def test_without_a_compiler_the_reason_names_both_failures(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("WEIGHTSYNC_CACHE_DIR", str(tmp_path / "cache"))
    library, path, why = native._load_helper(tmp_path / "missing.so.1")
    assert library is None and path is None
    assert why.startswith("no compiled _stream_copy helper; building it at first use: compiling") and "failed" in why
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == [next((tmp_path / "cache").glob("*.lock")).name]


def test_an_unusable_cache_is_a_reason_not_an_import_error(tmp_path: pathlib.Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("WEIGHTSYNC_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    library, path, why = native._load_helper(tmp_path / "missing.so.1")
    assert library is None and path is None and "cannot build it in the cache: " in why, why


BUILD = """
import pathlib, sys
from weightsync.core.native.build import cached_library
path, why = cached_library(pathlib.Path(sys.argv[1]))
print(path, why)
"""


@pytest.mark.parametrize("shared_cache", [True, False])
def test_processes_starting_together_compile_once(tmp_path: pathlib.Path, shared_cache: bool) -> None:
    # Four processes that find no library at the same moment (Ray workers, test workers): one compiles, the others
    # wait for it and load its library. Control (separate caches): the wrapper counts every compile.
    compiler, log = counting_compiler(tmp_path, delay_s=1.0)
    processes = []
    for index in range(4):
        cache = tmp_path / ("cache" if shared_cache else f"cache{index}")
        env = {**os.environ, "CC": compiler, "WEIGHTSYNC_CACHE_DIR": str(cache)}
        processes.append(subprocess.Popen([sys.executable, "-c", BUILD, str(SOURCE)], env=env, text=True,
                                          stdout=subprocess.PIPE))
    outputs = [process.communicate(timeout=120)[0].split() for process in processes]
    assert all(len(output) == 1 for output in outputs), outputs  # a path each, and no reason
    assert compiles(log) == (1 if shared_cache else 4)
    assert len({output[0] for output in outputs}) == (1 if shared_cache else 4)
    assert not list(tmp_path.glob("cache*/*.partial"))


def test_a_checkout_without_its_library_imports_the_helper(tmp_path: pathlib.Path) -> None:
    # The reused-environment case end to end: a copy of the package's source tree with no library beside the native
    # module, first on the import path, imported in a fresh interpreter.
    tree = tmp_path / "src" / "weightsync" / "core"
    shutil.copytree(SOURCE.parent.parent, tree, ignore=shutil.ignore_patterns("*.so.1", "__pycache__"))
    code = "import weightsync.core.native as t; print(t.__file__); print(t.HELPER_PATH); print(t.STREAM_COPY)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "src"), os.environ.get("PYTHONPATH", "")]),
           "WEIGHTSYNC_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            check=True)
    module, library, copy = result.stdout.splitlines()
    assert pathlib.Path(module) == tree / "native" / "__init__.py"
    assert pathlib.Path(library).parent == tmp_path / "cache" and copy.endswith("non-temporal stores")
    # Control: with the helper turned off the same tree copies with memmove and builds nothing more.
    env["WEIGHTSYNC_STREAM_COPY"] = "0"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            check=True)
    assert result.stdout.splitlines()[1:] == ["None", "memmove (WEIGHTSYNC_STREAM_COPY=0)"]
