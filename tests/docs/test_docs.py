"""The README and the docs as a reader meets them: a front door of at most 120 lines, no relative link that leads
nowhere, and every test the feature matrix names exists."""

from __future__ import annotations

import pathlib
import re

from tests.conftest import ROOT

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_TEST = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(\[[^\]]*\])?`")


def documents() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def dead_links(page: pathlib.Path) -> list[str]:
    """The relative links of ``page`` whose file (the part before any ``#``) does not exist."""
    dead = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, a mail address, or an anchor on the page itself
        if not (page.parent / target.split("#", 1)[0]).exists():
            dead.append(target)
    return dead


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, len(lines)
    text = "\n".join(lines[:5])
    assert "vLLM" in text and "verl" in text  # what it is for, first


def test_no_relative_link_leads_nowhere() -> None:
    assert len(documents()) > 10
    dead = {str(page.relative_to(ROOT)): links for page in documents() if (links := dead_links(page))}
    assert not dead, dead


def test_the_link_checker_finds_a_dead_link(tmp_path: pathlib.Path) -> None:
    """Negative control."""
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#part) [web](https://example.org) [gone](missing.md#x)")
    assert dead_links(page) == ["missing.md#x"]


def test_every_test_the_feature_matrix_names_exists() -> None:
    named = _TEST.findall((ROOT / "docs" / "guide" / "matrix.md").read_text())
    assert len(named) >= 14, named  # one per cell (untested ones say so)
    missing = [f"{path}::{name}" for path, name, _ in named
               if not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE)]
    assert not missing, missing
