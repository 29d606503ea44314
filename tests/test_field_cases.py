"""Every field case id cited in src/, tests/, docs/ and the README (K04, test_k04_...)
is defined in docs/field-cases.md, so a reader of a clone can look each one up."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"\bK(\d\d)\b|\btest_k(\d\d)_")
DEFINED = re.compile(r"^\*\*K(\d\d) ", re.MULTILINE)


def _cited() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    paths = [*ROOT.glob("src/**/*.py"), *ROOT.glob("src/**/*.md"), *ROOT.glob("tests/**/*.py"),
             *ROOT.glob("docs/*.md"), ROOT / "README.md"]
    for path in sorted(p for p in paths if p.name != "field-cases.md"):
        for match in CITED.finditer(path.read_text(encoding="utf-8")):
            out.setdefault("K" + (match.group(1) or match.group(2)), set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_cited_case_id_is_defined():
    defined = {"K" + n for n in DEFINED.findall((ROOT / "docs" / "field-cases.md").read_text(encoding="utf-8"))}
    cited = _cited()
    assert cited, "no case ids found: the pattern or the paths are wrong"
    assert {k: sorted(v) for k, v in cited.items() if k not in defined} == {}


def test_cases_are_defined_once_in_order():
    ids = DEFINED.findall((ROOT / "docs" / "field-cases.md").read_text(encoding="utf-8"))
    assert ids == [f"{n:02d}" for n in range(1, 25)]
