"""What the codemod records about one source text: the sites it rewrites and the sites it deliberately leaves alone."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.migrate.rules import Rule

__all__ = ["Finding", "Note"]


@dataclass(frozen=True)
class Finding:
    """One site the codemod rewrites (or, under ``--check``, would rewrite). ``line`` and ``column`` are 1-based."""

    rule: Rule
    line: int
    column: int
    message: str


@dataclass(frozen=True)
class Note:
    """A site the codemod recognised but deliberately left alone, with the reason; it never makes ``--check`` fail."""

    line: int
    column: int
    message: str
