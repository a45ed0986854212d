"""Loading the before/after fixtures under ``cases/``.

Each case is ``cases/<name>.before.txt`` and, when the codemod changes it, ``cases/<name>.after.txt``. The fixtures
are deliberately not ``.py`` files: they hold the old ``trainer=`` spelling (and one syntax error) that mypy, the repo
hooks and ``weightsync migrate --check`` over the repository must not see. The first line of a ``before`` file may be
``# rules: WS001 WS004`` (the rule IDs the codemod must report), ``# rules: none`` or ``# rules: unparsable``; a file
without that line (the empty-file case) expects no rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CASES_DIRECTORY = Path(__file__).parent / "cases"
_BEFORE_SUFFIX = ".before.txt"
_AFTER_SUFFIX = ".after.txt"
_RULES_HEADER = "# rules:"


class CaseFileError(Exception):
    """A fixture under cases/ is malformed."""


@dataclass(frozen=True)
class Case:
    name: str
    before: str
    # What the codemod must produce; equal to `before` for a case that must stay untouched.
    after: str
    expected_rules: frozenset[str]
    unparsable: bool

    @property
    def changes(self) -> bool:
        return self.after != self.before


def _read(path: Path) -> str:
    # newline="" keeps line endings exactly as stored, so a case can test them.
    with path.open(encoding="utf-8", newline="") as stream:
        return stream.read()


def load_case(name: str) -> Case:
    before_path = CASES_DIRECTORY / f"{name}{_BEFORE_SUFFIX}"
    after_path = CASES_DIRECTORY / f"{name}{_AFTER_SUFFIX}"
    before = _read(before_path)
    after = _read(after_path) if after_path.exists() else before
    first_line = before.splitlines()[0] if before else ""
    expected_rules: frozenset[str] = frozenset()
    unparsable = False
    if first_line.startswith(_RULES_HEADER):
        words = first_line.removeprefix(_RULES_HEADER).split()
        if words == ["unparsable"]:
            unparsable = True
        elif words != ["none"]:
            expected_rules = frozenset(words)
    if after_path.exists() and after == before:
        raise CaseFileError(f"{after_path.name} equals its before file; delete it to mean 'unchanged'")
    return Case(name, before, after, expected_rules, unparsable)


def case_names() -> list[str]:
    names = sorted(path.name.removesuffix(_BEFORE_SUFFIX) for path in CASES_DIRECTORY.glob(f"*{_BEFORE_SUFFIX}"))
    orphans = sorted(
        path.name for path in CASES_DIRECTORY.glob(f"*{_AFTER_SUFFIX}")
        if path.name.removesuffix(_AFTER_SUFFIX) not in names
    )
    if orphans:
        raise CaseFileError(f"after files without a before file: {orphans}")
    return names


def all_cases() -> list[Case]:
    return [load_case(name) for name in case_names()]
