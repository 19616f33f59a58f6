"""The docs match the code: every `make` target, config key, recipe and link the README and
docs/ name exists, and every config key is documented."""

from __future__ import annotations

import re

import pytest

from conftest import REPO
from monarch_sky.config_help import key_table
from monarch_sky.recipes import RECIPES

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KEYS = {key for key, _, _ in key_table()}


def spans(text: str) -> list[str]:
    """Inline code spans (`...`), outside fenced blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", text)


def code(text: str) -> str:
    """Everything in code: fenced blocks and inline spans."""
    return "\n".join(re.findall(r"```.*?```", text, flags=re.S) + spans(text))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_make_target_a_page_names_exists(page):
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", code(page.read_text())))
    assert named - targets == set(), f"{page.name} names make targets the Makefile lacks"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_config_key_a_page_sets_exists(page):
    set_keys = {m.group(1) for span in spans(page.read_text()) for m in [re.match(r"([a-z_]+(?:\.[a-z_]+)*)=[^=\s]", span)] if m}
    assert set_keys - KEYS == set(), f"{page.name} sets keys the config does not have"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_recipe_and_link_a_page_names_exists(page):
    text = page.read_text()
    for path in set(re.findall(r"\brecipes/[\w-]+\.yaml", text)):
        assert (REPO / path).exists(), f"{page.name}: {path}"
    for name in set(re.findall(r"\bllama3_\w+", text)):
        assert name in RECIPES, f"{page.name}: recipe {name}"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


def test_the_configuration_page_documents_every_key():
    table = (REPO / "docs" / "configuration.md").read_text()
    documented = {name for row in re.findall(r"^\| (.+?) \|", table, flags=re.M) for name in re.findall(r"`([a-z_.]+)`", row)}
    assert KEYS - documented == set(), "keys missing from docs/configuration.md"


def test_the_readme_stays_a_readme():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
