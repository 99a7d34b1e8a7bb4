"""The user documentation: a short README, and links between the pages that resolve."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_is_at_most_200_lines():
    """Issue 60: what it is, results, the two commands, three examples, links into the guide."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_every_relative_link_of_the_docs_resolves():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target, _ in LINK.findall(page.read_text())
              if "://" not in target and not (page.parent / target).exists()]
    assert broken == []
    assert len(PAGES) > 5 and any(LINK.search(page.read_text()) for page in PAGES)
