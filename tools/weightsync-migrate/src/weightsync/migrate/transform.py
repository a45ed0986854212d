"""The codemod's entry point: ``migrate_source`` parses one source text, runs the transformer over it and checks that
what comes back still parses. The transformer itself, and how it decides what to rewrite, is in ``migrator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from weightsync.migrate.findings import Finding, Note
from weightsync.migrate.migrator import Migrator

__all__ = [
    "Finding",
    "MigrationError",
    "MigrationResult",
    "Note",
    "UnparsableSourceError",
    "migrate_source",
]


@dataclass(frozen=True)
class MigrationResult:
    """The outcome for one source text: the rewritten text and every site rewritten or left alone."""

    original: str
    migrated: str
    # The migrated text encoded as the original was (PEP 263 declaration or UTF-8); what gets written to disk.
    migrated_bytes: bytes
    encoding: str
    findings: tuple[Finding, ...]
    notes: tuple[Note, ...]

    @property
    def changed(self) -> bool:
        return self.migrated != self.original


class UnparsableSourceError(Exception):
    """The source is not Python that LibCST can parse; nothing about it can be migrated safely."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column


class MigrationError(Exception):
    """The codemod produced something that does not parse; a bug in a rule. The source is left untouched."""


def migrate_source(source: str | bytes) -> MigrationResult:
    """Migrate one module's source text.

    ``bytes`` are decoded the way Python would (PEP 263 coding cookie, else UTF-8) and ``migrated_bytes`` is encoded
    the same way, so a file round-trips exactly apart from the rewritten identifiers.
    """
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as error:
        raise UnparsableSourceError(error.message, error.editor_line, error.editor_column) from error
    except (SyntaxError, UnicodeDecodeError, LookupError) as error:
        # Encoding detection failed (bytes that are not UTF-8 without a coding cookie, an unknown cookie) or the
        # bytes are not in the declared encoding: Python could not import this file either.
        raise UnparsableSourceError(f"cannot decode source: {error}") from error
    except RecursionError as error:
        raise UnparsableSourceError("source nests too deeply for the parser") from error

    wrapper = cst.MetadataWrapper(module)
    migrator = Migrator()
    migrated_module = wrapper.visit(migrator)
    original_text = module.code
    migrated_text = migrated_module.code
    if migrated_text != original_text:
        # Cheap insurance that a rule never damages a file: what we would write must still parse.
        try:
            cst.parse_module(migrated_text)
        except cst.ParserSyntaxError as error:
            raise MigrationError(f"the rewritten source does not parse ({error.message}); nothing written") from error
    return MigrationResult(
        original=original_text,
        migrated=migrated_text,
        migrated_bytes=migrated_module.bytes,
        encoding=module.encoding,
        findings=tuple(sorted(migrator.findings, key=lambda f: (f.line, f.column, f.rule.id))),
        notes=tuple(sorted(migrator.notes, key=lambda n: (n.line, n.column))),
    )
