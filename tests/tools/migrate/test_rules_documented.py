"""Every rule is documented in both places users look: the rules module and docs/MIGRATING.md."""

from __future__ import annotations

import re
from pathlib import Path

from weightsync.migrate import ALL_RULES, rules

MIGRATING = Path(__file__).resolve().parents[3] / "docs" / "MIGRATING.md"


def test_rules_table_in_migrating_md_matches_the_code() -> None:
    text = MIGRATING.read_text(encoding="utf-8")
    documented = re.findall(r"^\| (WS\d{3}) \|", text, flags=re.MULTILINE)
    assert documented == [rule.id for rule in ALL_RULES]


def test_rules_module_docstring_describes_every_rule() -> None:
    docstring = rules.__doc__ or ""
    described = re.findall(r"^(WS\d{3})$", docstring, flags=re.MULTILINE)
    assert described == [rule.id for rule in ALL_RULES]
