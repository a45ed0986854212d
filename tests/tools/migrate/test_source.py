"""migrate_source on its own: encodings, line endings, notes, and results that the CLI builds on."""

from __future__ import annotations

import codecs

import libcst as cst
import pytest

from weightsync.migrate import ALL_RULES, UnparsableSourceError, migrate_source

KEYWORD_CALL = (
    "from verl.checkpoint_engine import CheckpointEngineManager\n"
    "m = CheckpointEngineManager(config=c, trainer=w, replicas=r)\n"
)


def test_crlf_line_endings_are_kept() -> None:
    source = KEYWORD_CALL.replace("\n", "\r\n")
    result = migrate_source(source)
    assert result.migrated == source.replace("trainer=", "actor_wg=")
    assert "\r\n" in result.migrated and "\n" not in result.migrated.replace("\r\n", "")


def test_bytes_in_declared_encoding_round_trip() -> None:
    source = ("# -*- coding: latin-1 -*-\n# Größe\n" + KEYWORD_CALL).encode("latin-1")
    result = migrate_source(source)
    assert codecs.lookup(result.encoding).name == "iso8859-1"
    assert result.migrated_bytes == source.replace(b"trainer=", b"actor_wg=")


def test_undecodable_bytes_are_unparsable() -> None:
    with pytest.raises(UnparsableSourceError):
        migrate_source(b"x = '\xff\xfe'\n")


def test_syntax_error_reports_line() -> None:
    with pytest.raises(UnparsableSourceError) as raised:
        migrate_source("x = 1\ndef broken(:\n")
    assert raised.value.line == 2


def test_written_keywords_use_pep8_spacing() -> None:
    result = migrate_source(
        "from verl.checkpoint_engine import CheckpointEngineManager\nm = CheckpointEngineManager(c, w, r)\n"
    )
    assert "CheckpointEngineManager(config=c, actor_wg=w, replicas=r)" in result.migrated
    assert " = c" not in result.migrated


def test_unchanged_source_is_returned_verbatim() -> None:
    source = "x  =  1   # odd spacing\n\n\n"
    result = migrate_source(source)
    assert not result.changed
    assert result.migrated == source
    assert result.findings == ()


def test_rule_ids_are_unique_and_sequential() -> None:
    ids = [rule.id for rule in ALL_RULES]
    assert ids == [f"WS{number:03d}" for number in range(1, len(ids) + 1)]


def test_notes_explain_sites_left_alone() -> None:
    result = migrate_source(
        "from verl.checkpoint_engine import CheckpointEngineManager\n"
        "m = CheckpointEngineManager(c, trainer=w, actor_wg=w2)\n"
    )
    # The call already passes actor_wg=: renaming would make a duplicate keyword, so it is only noted.
    assert "trainer=w" in result.migrated
    assert [note.line for note in result.notes] == [2]
    assert "actor_wg=" in result.notes[0].message


def test_result_parses() -> None:
    result = migrate_source(KEYWORD_CALL)
    cst.parse_module(result.migrated)
