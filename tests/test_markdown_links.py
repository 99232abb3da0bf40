"""The prose a newcomer reads: README.md is a door (short, pointing into docs/), and
every relative link in README.md, docs/ and the other top-level pages names a file
that exists (links found by a real Markdown parser, so text in code spans is not a
link)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "RELIABILITY.md",
                *(ROOT / "docs").glob("*.md")])
README_MAX_LINES = 250


def link_targets(page: Path) -> list[str]:
    """Every link and image target in ``page``, as written."""
    found: list[str] = []

    def walk(tokens: list[Token]) -> None:
        for token in tokens:
            if token.type == "link_open":
                found.append(str(token.attrGet("href")))
            elif token.type == "image":
                found.append(str(token.attrGet("src")))
            if token.children:
                walk(token.children)

    walk(MarkdownIt("commonmark").enable("table").parse(page.read_text()))
    return found


def relative(target: str) -> bool:
    parts = urlsplit(target)
    return not parts.scheme and not parts.netloc and bool(parts.path)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_names_a_file_that_exists(page: Path) -> None:
    missing = [target for target in link_targets(page) if relative(target)
               and not (page.parent / unquote(urlsplit(target).path)).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_link_finder_sees_links_and_images_but_not_code() -> None:
    page = ROOT / "README.md"
    targets = link_targets(page)
    assert "docs/ARCHITECTURE.md" in targets and "docs/web-ui.png" in targets
    assert not any(t.startswith("http://127.0.0.1") for t in targets)  # code, not links


def test_the_readme_is_a_door_into_docs() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {t for t in link_targets(ROOT / "README.md") if relative(t)}
    # Every topic page is reachable from the door.
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"not linked from README.md: {sorted(pages - linked)}"
