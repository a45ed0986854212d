"""Before/after cases: every fixture under cases/ is migrated and compared, then migrated again (idempotence)."""

from __future__ import annotations

import pytest

from tests.tools.migrate.casefiles import Case, all_cases, case_names, load_case
from weightsync.migrate import ALL_RULES, UnparsableSourceError, migrate_source

CASES = case_names()
PARSABLE_CASES = [name for name in CASES if not load_case(name).unparsable]

# Names verl's rename deliberately kept (they mean other things), and prose: each must survive untouched wherever it
# appears, including inside classes and calls the codemod does rewrite.
KEEP_LIST = (
    "config.trainer",
    "num_trainer",
    "trainer_pool",
    "create_trainer_worker_group",
    "trainer step",
)


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", CASES)
def test_case_migrates_to_expected(name: str) -> None:
    case = load_case(name)
    if case.unparsable:
        with pytest.raises(UnparsableSourceError):
            migrate_source(case.before)
        return
    result = migrate_source(case.before)
    assert result.migrated == case.after
    assert result.changed == case.changes
    assert {finding.rule.id for finding in result.findings} == case.expected_rules


@pytest.mark.parametrize("name", PARSABLE_CASES)
def test_case_is_idempotent(name: str) -> None:
    case = load_case(name)
    second = migrate_source(case.after)
    assert second.migrated == case.after
    assert second.findings == ()


def _cases_containing(token: str) -> list[Case]:
    return [case for case in all_cases() if token in case.before]


@pytest.mark.parametrize("token", KEEP_LIST)
def test_keep_list_name_survives(token: str) -> None:
    containing = _cases_containing(token)
    assert containing, f"no case exercises the keep-list name {token!r}"
    for case in containing:
        assert case.after.count(token) == case.before.count(token), case.name


def test_every_rule_is_exercised_by_some_case() -> None:
    exercised = set().union(*(case.expected_rules for case in all_cases()))
    assert exercised == {rule.id for rule in ALL_RULES}


def test_reported_positions_point_at_the_old_spelling() -> None:
    source = load_case("verl_engine_subclass").before
    lines = source.splitlines()
    result = migrate_source(source)
    for finding in result.findings:
        if finding.rule.id in {"WS005", "WS006"}:
            text_at_site = lines[finding.line - 1][finding.column - 1 :]
            assert text_at_site.startswith(("trainer_world_size", "trainer_kwargs")), finding
