"""The docs a newcomer reads: README.md stays short, docs/index.md names every doc, every link resolves.

* Every ``docs/*.md`` is linked from ``docs/index.md``.
* Every relative link in README.md and docs/*.md names a file (or folder) inside the repository, and
  a ``#section`` of a Markdown file names one of its headings (GitHub's anchors).
* README.md names no path outside the repository (no ``../``) and stays under ``README_MAX_LINES``
  lines and ``README_MAX_BYTES`` bytes: the rest lives in docs/.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from launcher import REPO

DOCS = REPO / "docs"
README_MAX_LINES, README_MAX_BYTES = 120, 10_000

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md"))]


def links(page: Path) -> list[str]:
    """The targets of the page's Markdown links, outside code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", page.read_text()), re.M)
    seen: dict[str, int] = {}
    found = set()
    for slug in map(anchor, headings):
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_anchor_follows_github():
    assert anchor("Upcycling: an MoE checkpoint from a dense one") == "upcycling-an-moe-checkpoint-from-a-dense-one"
    assert anchor("The `\"moe\"` block of the DeepSpeed config") == "the-moe-block-of-the-deepspeed-config"
    assert anchor("Overlap: `--overlap-chunks N` (`moe.overlap_chunks`)") == "overlap---overlap-chunks-n-moeoverlap_chunks"


def test_index_names_every_doc():
    named = {(DOCS / target.split("#")[0]).resolve() for target in links(DOCS / "index.md")}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "index.md" and p.resolve() not in named]
    assert not missing, f"docs/index.md does not link to: {', '.join(missing)}"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # https:, mailto:
            continue
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if REPO not in file.parents and file != REPO:
            bad.append(f"{target}: outside the repository")
        elif not file.exists():
            bad.append(f"{target}: no such file")
        elif section and file.suffix == ".md" and section not in anchors(file):
            bad.append(f"{target}: {file.relative_to(REPO)} has no heading #{section}")
    assert not bad, f"{page.relative_to(REPO)}: " + "; ".join(bad)


def test_readme_short_and_inside_the_repository():
    text = (REPO / "README.md").read_text()
    assert "../" not in text, "README.md names a path outside the repository"
    lines, size = text.count("\n"), len(text.encode())
    assert lines <= README_MAX_LINES and size <= README_MAX_BYTES, (
        f"README.md is {lines} lines / {size} bytes; at most {README_MAX_LINES} / {README_MAX_BYTES}: "
        "move the detail into docs/")
