"""Build hook: compile ``weightsync/core/_stream_copy.c`` into a plain shared library (loaded with ctypes).

The helper is an optimisation only. Where no C compiler is found, or it fails, the build goes on without it and
``weightsync.core.tensors`` copies with libc ``memmove`` (``weightsync doctor`` says which). The library uses no
Python API, so no Python headers are needed, and one build serves every Python version of the platform.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from hatchling.builders.config import BuilderConfig
from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from packaging.tags import sys_tags

SOURCE = Path("src/weightsync/core/_stream_copy.c")
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
            build_data["force_include"][str(root / LIBRARY)] = str(Path("weightsync/core") / LIBRARY.name)


def _compile(source: Path, library: Path) -> bool:
    if os.environ.get("WEIGHTSYNC_STREAM_COPY") == "0" or not sys.platform.startswith("linux"):
        return False
    compiler = shlex.split(os.environ.get("CC", "")) or [
        found for found in (shutil.which(name) for name in ("cc", "gcc", "clang")) if found][:1]
    if not compiler:
        print("weightsync-core: no C compiler found; host copies will use memmove", file=sys.stderr)
        return False
    command = [*compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        print(f"weightsync-core: compiling {source.name} failed ({detail}); host copies will use memmove",
              file=sys.stderr)
        return False
    return True
