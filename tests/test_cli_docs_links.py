"""Every relative link in README.md and docs/*.md points to a file inside the repository
(a clone has no ../shared folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repo(page):
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        path = target.split("#")[0]
        if not path or re.match(r"^[a-z]+:", path):  # in-page anchor, http(s), mailto
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or ROOT not in resolved.parents:
            bad.append(target)
    assert not bad, f"{page.name}: links that do not resolve in the repository: {bad}"
