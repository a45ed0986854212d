"""Fresh interpreters for the checks that need one: a fault, a build lock, an install in a new process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def run_python(source: str, *, timeout: float = 300,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``source`` in a fresh interpreter (the emulator installs itself there, as in any worker process)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(source)], check=False,
                          capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
