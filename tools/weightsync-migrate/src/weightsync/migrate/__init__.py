"""``weightsync migrate``: a LibCST codemod from the ``trainer`` spelling to ``actor_wg``.

verl renamed the argument its ``CheckpointEngineManager`` took for the actor worker group from ``trainer=`` to
``actor_wg=`` (and ``build_topology``'s ``trainer_world_size`` to ``actor_wg_world_size``); weightsync uses the new
names only, as keyword-only parameters. This package rewrites downstream code accordingly. The rules are listed in
:mod:`weightsync.migrate.rules`; ``docs/MIGRATING.md`` explains the change and how to run the tool.

Entry points: :func:`main` (``python -m weightsync.migrate``), and :func:`add_arguments` + :func:`run` for the
``weightsync`` CLI to embed the same command; :func:`migrate_source` for programmatic use on a single source text.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from weightsync.migrate.cli import add_arguments, main, run
from weightsync.migrate.rules import ALL_RULES, Rule
from weightsync.migrate.transform import (
    Finding,
    MigrationError,
    MigrationResult,
    Note,
    UnparsableSourceError,
    migrate_source,
)

__version__ = _version("weightsync-migrate")
"""This distribution's version (from its installed metadata)."""

__all__ = [
    "ALL_RULES",
    "Finding",
    "MigrationError",
    "MigrationResult",
    "Note",
    "Rule",
    "UnparsableSourceError",
    "add_arguments",
    "main",
    "migrate_source",
    "run",
]
