"""Releasable: every distribution of the repository builds a wheel, and ``weightsync[shm,ray]`` (what the README's
quickstart installs) and the CLI installed from those wheels alone (not editable, nothing of the checkout on the
path) into a fresh virtual environment run an shm update between two processes there, and the README's quickstart,
as written, with a Ray cluster of its own: it exits 0, prints what the README says, and leaves nothing in
``/dev/shm``. The testbed is a distribution of its own, the CLI's extra ``[testbed]``:
the CLI's wheel holds none of it, and the CLI installed without it says what to install for ``bench --hosts``.

    python3 tools/wheel-check/wheel_check.py [--keep DIR]
    python3 tools/wheel-check/wheel_check.py --build DIR   # build the wheels and the venv into DIR, and stop
    python3 tools/wheel-check/wheel_check.py --run DIR     # then run the checks with what --build left in DIR

CI builds in the background while the suite runs (most of the minute it takes is pip unpacking torch) and runs the
checks in line, where no other test touches ``/dev/shm``.

Needs hatch (``python3 -m pip install hatch``) and the package indexes for the third-party dependencies (torch is
pinned to the development build). Prints one line per step; exits non-zero, saying why, at the first failure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"
"""The development environments' torch (a CPU build on these machines' disk); a library only declares a range."""
NO_TESTBED = "weightsync bench: --hosts needs the emulated testbed: pip install 'weightsync-cli[testbed]'"
"""What ``weightsync bench --hosts 2`` says, with exit status 2, where the testbed is not installed."""

UPDATE = """
import pathlib, sys
import weightsync.core, weightsync.shm
from weightsync.api.testing import EngineHarness

for module in (weightsync.core, weightsync.shm):
    assert pathlib.Path(module.__file__).is_relative_to(sys.prefix), (module.__name__, module.__file__, sys.prefix)
harness = EngineHarness("shm", receivers=1, bucket_bytes=1 << 20, timeout=120)
harness.start()
try:
    harness.setup()
    for update in range(2):
        for mode in ("iterate", "copy_into"):
            sender, receiver = harness.update("dtypes", update, mode=mode)
            assert receiver["report"]["digest"] == sender["digest"], (sender, receiver)
    print("shm updates between", len(harness.pids), "processes: digests equal,", sender["digest"][:16])
finally:
    harness.close()
"""


def distributions() -> list[pathlib.Path]:
    """Every distribution's folder (one with a ``pyproject.toml``), in a stable order."""
    return sorted(path.parent for folder in ("packages", "adapters", "tools") for path in
                  (ROOT / folder).glob("*/pyproject.toml"))


def run(argv: list[str], *, cwd: pathlib.Path | None = None, env: dict[str, str] | None = None) -> str:
    print("+", " ".join(arg if len(arg) < 120 else arg.split()[0] + " ..." for arg in argv), flush=True)
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"wheel-check: {argv[0]} failed ({done.returncode}):\n{done.stdout[-4000:]}"
                         f"\n{done.stderr[-4000:]}")
    return done.stdout


def build(wheels: pathlib.Path) -> dict[str, pathlib.Path]:
    """One wheel per distribution, by distribution name."""
    built: dict[str, pathlib.Path] = {}
    for folder in distributions():
        name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
        before = set(wheels.glob("*.whl"))
        run([sys.executable, "-m", "hatch", "build", "-t", "wheel", str(wheels)], cwd=folder)
        new = set(wheels.glob("*.whl")) - before
        if len(new) != 1:
            raise SystemExit(f"wheel-check: {name} built {len(new)} wheels, not one")
        built[name] = new.pop()
    check_contents(built)
    print(f"built {len(built)} wheels: {', '.join(sorted(built))}", flush=True)
    return built


def check_contents(built: dict[str, pathlib.Path]) -> None:
    """Every wheel carries the repository's LICENSE (the Apache-2.0 its metadata names); ``weightsync`` is metadata
    only; the testbed's wheel holds ``weightsync/testbed`` (typed) and the CLI's none of it, at its old place
    (``weightsync/cli/testbed``) or its own."""
    license_text = (ROOT / "LICENSE").read_bytes()
    for name, path in built.items():
        with zipfile.ZipFile(path) as wheel:
            licenses = [entry for entry in wheel.namelist() if entry.endswith(".dist-info/licenses/LICENSE")]
            if len(licenses) != 1 or wheel.read(licenses[0]) != license_text:
                raise SystemExit(f"wheel-check: the {name} wheel does not carry the repository's LICENSE: {licenses}")
    if not built["weightsync-core"].name.endswith("-py3-none-any.whl"):  # what an index accepts on every platform
        raise SystemExit(f"wheel-check: the core wheel is not pure: {built['weightsync-core'].name}")
    files = {name: [entry for entry in zipfile.ZipFile(path).namelist() if ".dist-info/" not in entry]
             for name, path in built.items()}
    if files["weightsync"]:
        raise SystemExit(f"wheel-check: the weightsync wheel holds files of its own: {files['weightsync']}")
    testbed = files.get("weightsync-testbed", [])
    if "weightsync/testbed/py.typed" not in testbed or any(not entry.startswith("weightsync/testbed/")
                                                             for entry in testbed):
        raise SystemExit(f"wheel-check: the weightsync-testbed wheel is not weightsync/testbed alone: {testbed}")
    leaked = [entry for entry in files["weightsync-cli"]
              if entry.startswith(("weightsync/testbed/", "weightsync/cli/testbed/"))]
    if leaked:
        raise SystemExit(f"wheel-check: the CLI's wheel holds the testbed: {leaked}")


def install(wheels: pathlib.Path, venv: pathlib.Path) -> pathlib.Path:
    """A fresh venv with ``weightsync[shm,ray]`` and the CLI from ``wheels``; its python."""
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    # Ours from the wheels alone, first (an index can never stand in for one of them), then their dependencies.
    ours = ["weightsync[shm,ray]==0.1.0", "weightsync-cli==0.1.0", "weightsync-api[testing]==0.1.0"]  # (the kit)
    run([str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), "--no-deps",
         *(str(path) for path in wheels.glob("*.whl") if _needed(path.name))])
    run([str(python), "-m", "pip", "install", "--find-links", str(wheels), *ours, TORCH])
    listed = run([str(python), "-m", "pip", "list", "--format=freeze"])
    editable = run([str(python), "-m", "pip", "list", "--editable", "--format=freeze"]).split()
    if editable:
        raise SystemExit(f"wheel-check: editable installs in the fresh venv: {editable}")
    print("installed:", " ".join(line for line in listed.split() if line.startswith("weightsync")), flush=True)
    return python


def _needed(wheel: str) -> bool:
    """The wheels ``weightsync[shm]`` and the CLI pull (the CLI's own dependencies included)."""
    return wheel.split("-")[0] in {"weightsync", "weightsync_api", "weightsync_core", "weightsync_shm",
                                   "weightsync_cli", "weightsync_gloo", "weightsync_tcp", "weightsync_ray",
                                   "weightsync_migrate"}


def check_no_testbed(weightsync: pathlib.Path, *, cwd: pathlib.Path, env: dict[str, str]) -> None:
    """The CLI installed without its extra ``[testbed]`` names it for ``bench --hosts``, with a usage status."""
    done = subprocess.run([str(weightsync), "bench", "--hosts", "2"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 2 or done.stderr.strip() != NO_TESTBED:
        raise SystemExit(f"wheel-check: weightsync bench --hosts 2 without the testbed exited {done.returncode}, not "
                         f"2 with {NO_TESTBED!r}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    print(f"weightsync bench --hosts 2 without the testbed: exit 2, {done.stderr.strip()!r}", flush=True)


QUICKSTART_PRINTS = "shm True ['committed', 'committed']"
"""The last line the README's quickstart prints (the README says so under it)."""


def quickstart() -> str:
    """The README's quickstart: the first ``python`` block under its ``## Quickstart`` heading, verbatim."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Quickstart", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def _segments() -> set[str]:
    """Our segments in ``/dev/shm`` now."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("weightsync-")}


def check_quickstart(python: pathlib.Path, *, cwd: pathlib.Path, env: dict[str, str]) -> None:
    """The README's quickstart, run as written, in a Ray cluster of its own (its own temp folder: it cannot join
    another): exit 0, the README's last line, and no segment of ours left in ``/dev/shm``."""
    script = cwd / "quickstart.py"
    script.write_text(quickstart())
    before = _segments()
    own = {**{key: value for key, value in env.items() if key != "RAY_ADDRESS"}, "RAY_TMPDIR": str(cwd / "ray")}
    printed = run([str(python), str(script)], cwd=cwd, env=own).strip().splitlines()
    left = sorted(_segments() - before)
    if not printed or printed[-1] != QUICKSTART_PRINTS or left:
        raise SystemExit(f"wheel-check: the README's quickstart printed {printed[-3:]}, not {QUICKSTART_PRINTS!r}, "
                         f"or left {left} in /dev/shm")
    print(f"README quickstart: exit 0, {printed[-1]!r}, nothing left in /dev/shm", flush=True)


def prepare(work: pathlib.Path) -> None:
    """The wheels, checked, and a fresh venv of them, in ``work``."""
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    build(wheels)
    install(wheels, work / "venv")


def check(work: pathlib.Path) -> None:
    """With the venv ``prepare`` left in ``work``: the helper built at first use, doctor, the CLI without the
    testbed, an update between two processes and the README's quickstart."""
    python = work / "venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"wheel-check: no venv in {work}: run --build {work} first")
    clean = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    clean["WEIGHTSYNC_CACHE_DIR"] = str(work / "cache")  # the helper, built at first use, lands here
    doctor = run([str(work / "venv" / "bin" / "weightsync"), "doctor"], cwd=work, env=clean).splitlines()
    helper = [line.split(": ", 1)[1] for line in doctor if line.startswith("compiled helper (_stream_copy.c): ")]
    if not helper or not pathlib.Path(helper[0]).is_relative_to(work / "cache"):
        raise SystemExit(f"wheel-check: the pure core wheel's helper was not built at first use: {helper}")
    print(f"the core wheel is pure; its helper, built at first use: {helper[0]}", flush=True)
    shm = [line for line in doctor if line.split()[:2] == ["shm", "available"]]
    if not shm:
        raise SystemExit(f"wheel-check: weightsync doctor in the fresh venv does not list shm as available: {doctor}")
    print("weightsync doctor:", " ".join(shm[0].split()))
    check_no_testbed(work / "venv" / "bin" / "weightsync", cwd=work, env=clean)
    print(run([str(python), "-c", UPDATE], cwd=work, env=clean).strip())
    check_quickstart(python, cwd=work, env=clean)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--keep", type=pathlib.Path, help="build and install here, and leave it (default: a "
                       "temporary folder, removed at the end)")
    where.add_argument("--build", type=pathlib.Path, metavar="DIR", help="only build the wheels and the venv, here")
    where.add_argument("--run", type=pathlib.Path, metavar="DIR", help="only run the checks, with what --build left "
                       "here")
    args = parser.parse_args()
    if args.build:
        prepare(args.build)
        print(f"wheel-check: the wheels and their venv are in {args.build}: --run {args.build} checks them")
        return 0
    with tempfile.TemporaryDirectory(prefix="ws-wheels-") as scratch:
        work = args.run or args.keep or pathlib.Path(scratch)
        if not args.run:
            prepare(work)
        check(work)
    print("wheel-check: every distribution builds a wheel, the CLI's without the testbed; weightsync[shm,ray] and the "
          "CLI from them run an update, and the README's quickstart as written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
