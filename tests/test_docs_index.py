"""The documents a user reads first point at files that exist, and the results index lists every
results folder (so a session's new folder cannot go unindexed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adaspark.model.config import ARCHITECTURES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
# [text](target) and ![alt](target); a target ends at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCUMENTS = ("README.md", "docs/reference.md", "docs/results/README.md",
             "docs/results/HISTORY.md")


def relative_links(text: str) -> list[str]:
    """The link targets that name a file of this repository (no scheme, not a bare #anchor),
    without their #anchor."""
    targets = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_resolves(document):
    path = ROOT / document
    links = relative_links(path.read_text(encoding="utf-8"))
    assert links, f"{document} links to nothing: the pattern no longer reads its links"
    missing = [t for t in links if not (path.parent / t).exists()]
    assert not missing, f"{document} links to missing files: {missing}"


def test_the_link_reader_takes_file_links_and_skips_addresses_and_anchors():
    text = ("[a](docs/x.md) ![img](docs/p.png) [web](https://example.org) [here](#anchor) "
            "[b](y/z.md#part) [mail](mailto:a@b.c)")
    assert relative_links(text) == ["docs/x.md", "docs/p.png", "y/z.md"]


def indexed_folders(text: str) -> set[str]:
    """The results folders the index links to (a link's first path part)."""
    return {t.split("/", 1)[0] for t in relative_links(text) if "/" in t}


def test_the_results_index_lists_every_folder():
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    assert folders, "no results folders found"
    missing = sorted(folders - indexed_folders(INDEX.read_text(encoding="utf-8")))
    assert not missing, f"docs/results/README.md does not index: {missing}"


def test_the_index_check_fails_on_a_missing_folder():
    text = INDEX.read_text(encoding="utf-8")
    folders = indexed_folders(text)
    some = sorted(folders)[0]
    without = "\n".join(line for line in text.splitlines() if f"]({some}/" not in line)
    assert some not in indexed_folders(without)


def test_readme_names_every_architecture_the_engine_runs():
    words = set(re.findall(r"[a-z0-9]+", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert set(ARCHITECTURES) <= words


def test_readme_keeps_the_test_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = ".venv/bin/python -m pytest -q"
    assert command in ci.splitlines()
    assert f"bash scripts/setup.sh && {command}" in (ROOT / "README.md").read_text(
        encoding="utf-8")
