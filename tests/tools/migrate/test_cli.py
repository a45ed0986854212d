"""The command line: --check, --diff, in-place rewriting, exit statuses, --exclude, unparsable files."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.migrate.casefiles import load_case
from weightsync.migrate import add_arguments, main, run

CHECK_LINE = re.compile(r"^(?P<path>.+):(?P<line>\d+):(?P<column>\d+) (?P<rule>WS\d{3}) \S.*$")


def _write_case(directory: Path, case_name: str, file_name: str | None = None) -> Path:
    path = directory / (file_name or f"{case_name}.py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(load_case(case_name).before.encode("utf-8"))
    return path


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from tmp_path, so paths in output are relative and --exclude globs are resolved against it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_check_reports_each_site_and_exits_1(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_case(in_tmp, "verl_import_module_as")
    before = path.read_bytes()

    status = main(["--check", "verl_import_module_as.py"])

    out = capsys.readouterr().out.splitlines()
    assert status == 1
    assert path.read_bytes() == before
    matches = [CHECK_LINE.match(line) for line in out]
    assert all(matches), out
    assert {(m["path"], m["line"], m["rule"]) for m in matches if m} == {
        ("verl_import_module_as.py", "4", "WS001"),
        ("verl_import_module_as.py", "4", "WS002"),
    }


def test_check_exits_0_when_nothing_to_change(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_case(in_tmp, "already_migrated")
    _write_case(in_tmp, "keep_prose_strings_comments")
    assert main(["--check", "."]) == 0
    assert capsys.readouterr().out == ""


def test_diff_prints_unified_diff_and_writes_nothing(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_case(in_tmp, "verl_positional")
    before = path.read_bytes()

    status = main(["--diff", "verl_positional.py"])

    out = capsys.readouterr().out
    assert status == 1
    assert path.read_bytes() == before
    assert out.startswith("--- verl_positional.py\n+++ verl_positional.py\n@@ ")
    assert "-manager = CheckpointEngineManager(cfg.checkpoint_engine, actor_wg, rollout_replicas)\n" in out
    assert "+manager = CheckpointEngineManager(config=cfg.checkpoint_engine, actor_wg=actor_wg," in out


def test_in_place_rewrite_then_nothing_left(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = ["verl_engine_subclass", "manager_subclass", "weightsync_positional", "other_module_same_name"]
    paths = {name: _write_case(in_tmp / "src", name) for name in names}
    (in_tmp / "src" / "verl_engine_subclass.py").chmod(0o640)

    assert main(["src"]) == 0
    for name, path in paths.items():
        assert path.read_text(encoding="utf-8") == load_case(name).after
    assert (in_tmp / "src" / "verl_engine_subclass.py").stat().st_mode & 0o777 == 0o640
    assert "migrated src/manager_subclass.py" in capsys.readouterr().out

    # Idempotence through the CLI: a second run has nothing to do and rewrites nothing.
    modified = {name: path.stat().st_mtime_ns for name, path in paths.items()}
    assert main(["--check", "src"]) == 0
    assert main(["src"]) == 0
    assert {name: path.stat().st_mtime_ns for name, path in paths.items()} == modified
    assert sorted(p.name for p in (in_tmp / "src").iterdir()) == sorted(f"{n}.py" for n in names)  # no temp files


def test_unparsable_file_is_reported_skipped_and_does_not_change_status(
    in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = _write_case(in_tmp, "syntax_error")
    broken_bytes = broken.read_bytes()
    _write_case(in_tmp, "already_migrated")

    assert main(["--check", "."]) == 0
    assert "syntax_error.py:" in capsys.readouterr().err

    _write_case(in_tmp, "weightsync_keyword")
    assert main(["--check", "."]) == 1
    assert main(["."]) == 0
    captured = capsys.readouterr()
    assert "syntax_error.py:" in captured.err and "does not parse" in captured.err
    assert broken.read_bytes() == broken_bytes


def test_directories_are_walked_for_py_files_only(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_case(in_tmp / "pkg" / "sub", "weightsync_keyword", "module.py")
    _write_case(in_tmp / "pkg", "weightsync_keyword", "notes.txt")
    _write_case(in_tmp / "pkg" / ".hidden", "weightsync_keyword", "module.py")
    _write_case(in_tmp / "pkg" / "venv", "weightsync_keyword", "module.py")
    (in_tmp / "pkg" / "venv" / "pyvenv.cfg").write_text("home = /usr\n")

    assert main(["--check", "pkg"]) == 1
    reported = {line.split(":")[0] for line in capsys.readouterr().out.splitlines()}
    assert reported == {os.path.join("pkg", "sub", "module.py")}


def test_explicit_file_of_any_extension_is_migrated(in_tmp: Path) -> None:
    path = _write_case(in_tmp, "weightsync_keyword", "script")
    assert main([str(path)]) == 0
    assert path.read_text(encoding="utf-8") == load_case("weightsync_keyword").after


def test_exclude_globs(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for directory in ("tests/tools/migrate/cases", "tests/typing", "src"):
        _write_case(in_tmp / directory, "weightsync_keyword", "wrong.py")
    _write_case(in_tmp / "src", "weightsync_keyword", "generated_pb2.py")

    status = main(
        [
            "--check",
            "--exclude", "tests/tools/migrate/cases",  # a path glob: the directory and all below it
            "--exclude", "./tests/typing/",  # leading ./ and trailing / are tolerated
            "--exclude", "*_pb2.py",  # a component glob: matches a file name anywhere
            ".",
        ]
    )

    reported = {line.split(":")[0] for line in capsys.readouterr().out.splitlines()}
    assert status == 1
    assert reported == {os.path.join("src", "wrong.py")}
    assert main(["--check", "--exclude", "src", "--exclude", "tests", "."]) == 0


def test_exclude_globs_are_relative_to_the_path_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repository = tmp_path / "repository"
    _write_case(repository / "tests" / "tools" / "migrate" / "cases", "weightsync_keyword", "wrong.py")
    _write_case(repository / "src", "weightsync_keyword", "wrong.py")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")

    status = main(["--check", "--exclude", "tests/tools/migrate/cases", "--exclude", tmp_path.name, str(repository)])

    # The path glob applies below the PATH argument; the component glob never looks above it.
    reported = {line.split(":")[0] for line in capsys.readouterr().out.splitlines()}
    assert status == 1
    assert reported == {str(repository / "src" / "wrong.py")}


def test_exclude_applies_to_explicit_files(in_tmp: Path) -> None:
    _write_case(in_tmp, "weightsync_keyword", "skip_me.py")
    assert main(["--check", "--exclude", "skip_*.py", "skip_me.py"]) == 0


def test_missing_path_is_a_usage_error(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_case(in_tmp, "weightsync_keyword")
    assert main(["weightsync_keyword.py", "does_not_exist.py"]) == 2
    assert "does_not_exist.py" in capsys.readouterr().err
    assert "trainer=" in (in_tmp / "weightsync_keyword.py").read_text(encoding="utf-8")  # nothing was touched


def test_check_and_diff_are_mutually_exclusive(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check", "--diff", "."]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_no_paths_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    capsys.readouterr()


def test_notes_go_to_stderr_without_failing(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_case(in_tmp, "rename_conflict")
    assert main(["--check", "rename_conflict.py"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "rename_conflict.py:9:" in captured.err and "note:" in captured.err


def test_embedding_in_another_parser(in_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """How the `weightsync` CLI embeds the command: its own options plus a `migrate` subparser."""
    _write_case(in_tmp, "weightsync_keyword")
    parser = argparse.ArgumentParser(prog="weightsync")
    parser.add_argument("--check", action="store_true", help="an unrelated top-level option")
    subcommands = parser.add_subparsers(dest="command", required=True)
    add_arguments(subcommands.add_parser("migrate"))

    args = parser.parse_args(["migrate", "--check", "weightsync_keyword.py"])

    assert args.check is False  # the embedding parser's own option is not disturbed
    assert run(args) == 1
    assert "WS001" in capsys.readouterr().out


def test_python_dash_m_in_a_subprocess(in_tmp: Path) -> None:
    _write_case(in_tmp, "verl_keyword_from_base_module", "job.py")
    _write_case(in_tmp, "syntax_error", "broken.py")

    completed = subprocess.run(
        [sys.executable, "-m", "weightsync.migrate", "--check", "."],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )

    assert completed.returncode == 1, completed.stderr
    assert completed.stdout.startswith("job.py:4:")
    assert " WS001 " in completed.stdout
    assert "broken.py:" in completed.stderr
