"""Build hook: compile ``weightsync/core/native/_stream_copy.c`` into a plain shared library (loaded with ctypes) in
the source tree, for an editable install.

A wheel is pure Python (``py3-none-any``, which a package index accepts on every platform) and carries the C source:
``weightsync.core.native`` builds the library from it at first use into a per-user cache (``native/build.py``), on
the machine that runs it. The helper is an optimisation only: where no C compiler is found, or it fails, copies use
libc ``memmove``, delta updates send every bucket dense, and ``weightsync doctor`` says so and why. The library uses
no Python API, so no Python headers are needed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("src/weightsync/core/native/_stream_copy.c")
# Not ``*.so``: that suffix makes the file look like an extension module to anything that walks the package
# (pkgutil.walk_packages, documentation tools), which would then fail to import it.
LIBRARY = SOURCE.with_name("_stream_copy.so.1")


class StreamCopyHook(BuildHookInterface[BuilderConfig]):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        # Only for an editable install, which loads the library from the source tree; a wheel is pure (its C source
        # is built where it is installed; pyproject.toml keeps a library of the tree out of it).
        if version == "editable":
            _compile(Path(self.root) / SOURCE, Path(self.root) / LIBRARY)


def _compile(source: Path, library: Path) -> bool:
    if os.environ.get("WEIGHTSYNC_STREAM_COPY") == "0":
        return False
    why = _helper_build(source.with_name("build.py")).compile_library(source, library)
    if why:
        print(f"weightsync-core: {why}; host copies will use memmove", file=sys.stderr)
    return not why


def _helper_build(path: Path) -> Any:
    """``weightsync/core/native/build.py`` (standard library only), loaded by its path: neither weightsync nor
    torch is installed in pip's build environment. ``native`` compiles with the same code at first use."""
    spec = importlib.util.spec_from_file_location("_weightsync_helper_build", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
