"""Build hook: compile ``weightsync/core/native/_stream_copy.c`` into a plain shared library (loaded with ctypes).

The helper is an optimisation only. Where no C compiler is found, or it fails, the build goes on without it and
``weightsync.core.native`` copies with libc ``memmove`` (``weightsync doctor`` says which). The library uses no
Python API, so no Python headers are needed, and one build serves every Python version of the platform. The compile
itself is ``weightsync/core/native/build.py``, which ``native`` also calls when an editable checkout has lost its
library.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from packaging.tags import sys_tags

SOURCE = Path("src/weightsync/core/native/_stream_copy.c")
# Not ``*.so``: that suffix makes the file look like an extension module to anything that walks the package
# (pkgutil.walk_packages, documentation tools), which would then fail to import it.
LIBRARY = SOURCE.with_name("_stream_copy.so.1")


class StreamCopyHook(BuildHookInterface[BuilderConfig]):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        root = Path(self.root)
        if not _compile(root / SOURCE, root / LIBRARY):
            return
        if version != "editable":  # an editable install loads it from the source tree, where it was just built
            build_data["pure_python"] = False
            # No Python API in the library: any Python 3 of this platform can load it.
            build_data["tag"] = f"py3-none-{next(sys_tags()).platform}"
            build_data["force_include"][str(root / LIBRARY)] = str(Path("weightsync/core/native") / LIBRARY.name)


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
