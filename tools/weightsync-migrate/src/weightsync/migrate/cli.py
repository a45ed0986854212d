"""``weightsync migrate [--diff | --check] [--exclude GLOB]... PATH...``: files in, rewritten files (or a report) out.

Exit status: 0 when nothing needs to change (or, rewriting in place, when everything was rewritten); 1 when
``--check`` or ``--diff`` found something to change; 2 on a usage error, a path that does not exist, a file that
cannot be read or written, or a rule that produced unparsable code. A file that does not parse is reported on stderr
and skipped without affecting the exit status: it cannot hold a call we could have migrated safely, and one broken
file must not hide the result for the others.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import enum
import fnmatch
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from weightsync.migrate.transform import MigrationError, MigrationResult, UnparsableSourceError, migrate_source

PROG = "weightsync migrate"
EXIT_CLEAN = 0
EXIT_CHANGES_NEEDED = 1
EXIT_ERROR = 2

# Directories never worth walking: VCS metadata, caches, virtual environments (detected by pyvenv.cfg as well).
_SKIPPED_DIRECTORY_NAMES = frozenset({"__pycache__", "node_modules"})

DESCRIPTION = (
    "Rewrite code written against the old `trainer=` spelling of verl's and weightsync's checkpoint-engine APIs to "
    "`actor_wg=`. Files are rewritten in place unless --check or --diff is given. Directories are walked for *.py."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``migrate`` options to ``parser`` (a standalone parser or the ``weightsync`` CLI's subparser).

    The destinations are prefixed with ``migrate_`` so that they cannot collide with options of an embedding parser;
    pass the parsed namespace to :func:`run`.
    """
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--diff",
        dest="migrate_diff",
        action="store_true",
        help="print a unified diff of the changes and write nothing; exit 1 if anything would change",
    )
    mode.add_argument(
        "--check",
        dest="migrate_check",
        action="store_true",
        help="print `path:line:col WS00N message` for each site and write nothing; exit 1 if anything would change",
    )
    parser.add_argument(
        "--exclude",
        dest="migrate_exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help=(
            "skip files and directories matching GLOB (repeatable). A GLOB without '/' matches any single path "
            "component below a PATH (`--exclude cases`); one with '/' matches the path relative to the current "
            "directory or to the PATH it was found under, or any of its parent directories "
            "(`--exclude 'tests/tools/migrate/cases'`)"
        ),
    )
    parser.add_argument(
        "migrate_paths", nargs="+", metavar="PATH", help="files to migrate, or directories to walk for *.py files"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run; returns the exit status instead of exiting."""
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exit_request:  # --help, or a usage error argparse has already printed
        return exit_request.code if isinstance(exit_request.code, int) else EXIT_ERROR
    return run(args)


class _Mode(enum.Enum):
    WRITE = "write"
    CHECK = "check"
    DIFF = "diff"


@dataclass(frozen=True)
class _Options:
    mode: _Mode
    excludes: tuple[str, ...]
    paths: tuple[str, ...]

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> _Options:
        paths = getattr(args, "migrate_paths", None)
        excludes = getattr(args, "migrate_exclude", None) or []
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise TypeError("run() needs a namespace parsed by a parser set up with add_arguments()")
        if not isinstance(excludes, list) or not all(isinstance(e, str) for e in excludes):
            raise TypeError("the `migrate_exclude` option must be a list of glob strings")
        if getattr(args, "migrate_check", False):
            mode = _Mode.CHECK
        elif getattr(args, "migrate_diff", False):
            mode = _Mode.DIFF
        else:
            mode = _Mode.WRITE
        return cls(mode=mode, excludes=tuple(excludes), paths=tuple(paths))


def run(args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run ``weightsync migrate`` for a namespace produced by a parser set up with :func:`add_arguments`."""
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    options = _Options.from_namespace(args)

    missing = [path for path in options.paths if not os.path.exists(path)]
    if missing:
        for path in missing:
            print(f"{PROG}: error: no such file or directory: {path}", file=err)
        return EXIT_ERROR

    excluder = _Excluder(options.excludes)
    files_to_change = 0
    sites = 0
    failed = False
    for path in discover_files(options.paths, excluder):
        outcome = _migrate_file(path, options.mode, out, err)
        if outcome is None:
            failed = True
        elif outcome.changed:
            files_to_change += 1
            sites += outcome.sites

    if options.mode == _Mode.WRITE:
        if files_to_change:
            print(f"{PROG}: rewrote {files_to_change} file(s), {sites} site(s)", file=err)
        status = EXIT_CLEAN
    else:
        if files_to_change:
            print(f"{PROG}: {files_to_change} file(s), {sites} site(s) to migrate", file=err)
        status = EXIT_CHANGES_NEEDED if files_to_change else EXIT_CLEAN
    return EXIT_ERROR if failed else status


@dataclass(frozen=True)
class _FileOutcome:
    changed: bool
    sites: int


def _migrate_file(path: str, mode: _Mode, out: TextIO, err: TextIO) -> _FileOutcome | None:
    """Migrate one file in ``mode``; ``None`` when it failed in a way that must fail the run."""
    try:
        source = Path(path).read_bytes()
    except OSError as error:
        print(f"{path}: error: cannot read: {error.strerror or error}", file=err)
        return None
    try:
        result = migrate_source(source)
    except UnparsableSourceError as error:
        where = path if error.line is None else f"{path}:{error.line}:{error.column}"
        print(f"{where}: skipped, does not parse: {error.message}", file=err)
        return _FileOutcome(changed=False, sites=0)
    except MigrationError as error:
        print(f"{path}: error: {error}", file=err)
        return None
    except Exception as error:  # noqa: BLE001 - a bug on one file must not stop the run or reach the disk
        print(f"{path}: internal error, file left untouched: {type(error).__name__}: {error}", file=err)
        return None

    for note in result.notes:
        print(f"{path}:{note.line}:{note.column}: note: {note.message}", file=err)
    if not result.changed:
        return _FileOutcome(changed=False, sites=0)

    if mode == _Mode.CHECK:
        for finding in result.findings:
            print(f"{path}:{finding.line}:{finding.column} {finding.rule.id} {finding.message}", file=out)
    elif mode == _Mode.DIFF:
        out.write(unified_diff(path, result))
    else:
        try:
            _write_atomically(Path(path), result.migrated_bytes)
        except OSError as error:
            print(f"{path}: error: cannot write: {error.strerror or error}", file=err)
            return None
        print(f"migrated {path} ({len(result.findings)} site(s))", file=out)
    return _FileOutcome(changed=True, sites=len(result.findings))


def unified_diff(path: str, result: MigrationResult) -> str:
    """A unified diff from the original to the migrated text, labelled with ``path`` on both sides (``patch -p0``)."""
    lines = difflib.unified_diff(
        result.original.splitlines(keepends=True),
        result.migrated.splitlines(keepends=True),
        fromfile=path,
        tofile=path,
    )
    # A last line without a newline would otherwise glue itself to the next hunk header.
    return "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path``'s contents so that a crash leaves either the old file or the new one, never half of each."""
    target = path.resolve()  # write through a symlink instead of replacing the link with a plain file
    permissions = stat.S_IMODE(target.stat().st_mode)
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".migrate")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(data)
        os.chmod(temporary, permissions)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


class _Excluder:
    """Decides whether ``--exclude`` globs cover a path (see the option's help for the two kinds of GLOB)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        cleaned = [pattern.rstrip("/").removeprefix("./") for pattern in patterns]
        self._component_patterns = [p for p in cleaned if p and "/" not in p]
        self._path_patterns = [p for p in cleaned if "/" in p]
        self._cwd = Path.cwd()

    def excludes(self, path: str, root: str) -> bool:
        """Whether ``path``, found under the PATH argument ``root`` (or equal to it), is excluded.

        Component globs look only at the part of the path below ``root`` (and at ``root``'s own name), so that where
        the checkout happens to live never excludes it. Path globs are tried against the path relative to the current
        directory, relative to ``root``, and as an absolute path, each with all of its parent directories.
        """
        absolute = Path(os.path.abspath(path))
        absolute_root = Path(os.path.abspath(root))
        components = _relative_parts(absolute, absolute_root) or (Path(root).name,)
        if any(fnmatch.fnmatchcase(part, p) for part in components if part for p in self._component_patterns):
            return True
        candidates = {absolute.as_posix()} | {parent.as_posix() for parent in absolute.parents}
        for base in (self._cwd, absolute_root):
            parts = _relative_parts(absolute, base)
            candidates |= {Path(*parts[:end]).as_posix() for end in range(1, len(parts) + 1)}
        return any(fnmatch.fnmatchcase(c, p) for c in candidates for p in self._path_patterns)


def _relative_parts(path: Path, base: Path) -> tuple[str, ...]:
    """``path``'s components below ``base``; empty when it is ``base`` itself or not below it."""
    try:
        return path.relative_to(base).parts
    except ValueError:
        return ()


def discover_files(paths: Sequence[str], excluder: _Excluder) -> Iterator[str]:
    """Every file named in ``paths``, and every ``*.py`` file below the directories among them, once each, sorted
    within each directory so that output is stable."""
    seen: set[str] = set()
    for given in paths:
        for path in _expand(os.path.normpath(given), excluder):
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                yield path


def _expand(path: str, excluder: _Excluder) -> Iterator[str]:
    if excluder.excludes(path, root=path):
        return
    if not os.path.isdir(path):
        yield path
        return
    for root, directories, files in os.walk(path):
        directories[:] = sorted(
            name for name in directories if not _skipped_directory(os.path.join(root, name), name, path, excluder)
        )
        for name in sorted(files):
            candidate = os.path.join(root, name)
            if name.endswith(".py") and not excluder.excludes(candidate, root=path):
                yield os.path.normpath(candidate)


def _skipped_directory(path: str, name: str, root: str, excluder: _Excluder) -> bool:
    return (
        name.startswith(".")
        or name in _SKIPPED_DIRECTORY_NAMES
        or os.path.exists(os.path.join(path, "pyvenv.cfg"))
        or excluder.excludes(path, root=root)
    )
