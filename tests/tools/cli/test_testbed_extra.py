"""The testbed is an extra of the CLI (``weightsync-cli[testbed]``, the distribution weightsync-testbed): without it
``bench --hosts`` and ``bench --cleanup`` name the install and exit with a usage status before any work, and
everything else of the bench runs. Each check runs the CLI in a fresh interpreter where ``weightsync.testbed`` cannot
be imported (as where it is not installed), against the same command with the testbed importable as the control.
``tools/wheel-check`` runs the first check again on the CLI installed from its wheel alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

# argv[1]: "without" hides the testbed (a None in sys.modules makes importing it, or any of its modules, fail and
# importlib.util.find_spec answer None). Prints which of the bench's heavy imports the command made.
CLI = """
import sys
if sys.argv[1] == "without":
    sys.modules["weightsync.testbed"] = None
from weightsync.cli.main import main
code = main(sys.argv[2:])
print(" ".join(name for name in ("torch", "weightsync.cli.bench", "weightsync.testbed") if sys.modules.get(name)))
sys.exit(code)
"""


def cli(testbed: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", CLI, testbed, *args], capture_output=True, text=True, timeout=120,
                          check=False)


@pytest.mark.parametrize("args", [["--hosts", "2"], ["--hosts", "3", "--rails", "2"], ["--cleanup"]])
def test_without_the_testbed_hosts_and_cleanup_name_the_extra_before_any_work(args: list[str]) -> None:
    result = cli("without", "bench", *args)
    option = args[0]
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"weightsync bench: {option} needs the emulated testbed: pip install " \
                            "'weightsync-cli[testbed]'\n"
    assert result.stdout.strip() == ""  # no torch, nothing of the bench: no work started


@pytest.mark.parametrize(("args", "error"), [
    (["--hosts", "1"], "--hosts needs at least 2 hosts (a sender host and a receiving host)"),
    (["--hosts", "2", "--rails", "9"], "--rails must be 1..8"),  # (the testbed's MAX_RAILS)
])
def test_with_the_testbed_the_same_check_passes(args: list[str], error: str) -> None:
    """The control: the testbed importable, the command gets past that check to the next (wrong options here, so
    that no testbed is built); hidden, the same command stops at it."""
    assert cli("with", "bench", *args).stderr == f"weightsync bench: {error}\n"
    assert "needs the emulated testbed" in cli("without", "bench", *args).stderr


def test_the_local_bench_imports_without_the_testbed() -> None:
    """Every module of the bench that runs on this machine imports without it; only ``hosts`` needs it (the
    control: importing it fails the same way)."""
    hide = "import sys; sys.modules['weightsync.testbed'] = None; "
    local = subprocess.run([sys.executable, "-c", hide + "import weightsync.cli.bench, weightsync.cli.bench.worker"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert local.returncode == 0, local.stderr
    hosts = subprocess.run([sys.executable, "-c", hide + "import weightsync.cli.bench.hosts"], capture_output=True,
                           text=True, timeout=120, check=False)
    assert hosts.returncode == 1 and "ModuleNotFoundError: import of weightsync.testbed halted" in hosts.stderr, \
        hosts.stderr
