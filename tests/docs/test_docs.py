"""The in-repo docs stay true to the code: every module is on the README's code map, and every
``docs/architecture.md §N`` a comment cites exists (the old DESIGN.md is not in the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("shardc", "scripts", "tests")


def _sources() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p.name != "test_docs.py"]


def test_readme_code_map_names_every_module() -> None:
    readme = (ROOT / "README.md").read_text()
    dev = readme[readme.index("## Development"):]
    lines = {}  # package -> its line(s) of the code map
    for m in re.finditer(r"^  - `(?:shardc/)?(\w+)(?:/|\.py)`[^\n]*(?:\n    [^\n]*)*", dev, re.M):
        lines[m.group(1)] = m.group(0)
    missing = []
    for p in sorted((ROOT / "shardc").rglob("*.py")):
        rel = p.relative_to(ROOT / "shardc")
        if p.name == "__init__.py" and len(rel.parts) > 1:
            continue
        if len(rel.parts) == 1:  # top level: cli.py, errors.py (on the first line)
            if p.name != "__init__.py" and f"`{p.name}`" not in dev and f"`shardc/{p.name}`" not in dev:
                missing.append(str(rel))
            continue
        if f"`{p.name}`" not in lines.get(rel.parts[0], ""):
            missing.append(str(rel))
    assert not missing, f"README's code map (## Development) does not name: {missing}"


def test_no_code_cites_the_design_doc_outside_the_repo() -> None:
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in _sources()
           for i, line in enumerate(p.read_text().splitlines(), 1) if "DESIGN" in line and "§" in line]
    assert not bad, f"cite docs/architecture.md instead of DESIGN.md: {bad}"


@pytest.mark.parametrize("doc", ["architecture.md", "performance.md"])
def test_cited_doc_sections_exist(doc: str) -> None:
    text = (ROOT / "docs" / doc).read_text()
    sections = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", text, re.M))
    pattern = rf"docs/{re.escape(doc)}[^§\n]{{0,3}}§(\d+(?:\.\d+)?)"
    cited = {(str(p.relative_to(ROOT)), s) for p in _sources() + [ROOT / "README.md"]
             for s in re.findall(pattern, p.read_text())}
    assert cited, f"nothing cites docs/{doc}: the pattern is stale"
    unknown = sorted((f, s) for f, s in cited if s not in sections)
    assert not unknown, f"citations of sections docs/{doc} does not have: {unknown}"
