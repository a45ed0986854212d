"""weightsync.api stays light: importing it (and listing backends) pulls in no torch, ray or verl."""

from __future__ import annotations

import json
import subprocess
import sys


def _heavy_modules_after(code: str) -> list[str]:
    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m for m in ('torch', 'ray', 'verl') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return list(json.loads(out.strip().splitlines()[-1]))


def test_importing_the_api_imports_no_torch_ray_or_verl() -> None:
    code = "import weightsync.api\nfrom weightsync.api import *\nweightsync.api.available_backends()\n" \
           "weightsync.api.backend_statuses()"
    assert _heavy_modules_after(code) == []


def test_the_probe_can_see_a_heavy_import() -> None:
    # Negative control: the same probe notices torch when something does import it.
    assert _heavy_modules_after("import weightsync.api\nimport weightsync.core.wire.tensors") == ["torch"]
