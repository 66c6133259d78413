"""The in-repo docs stay true to the code: every module has one row in the code map
(docs/architecture.md §2.1), and every ``docs/architecture.md §N`` a comment cites exists (the old
DESIGN.md is not in the repository)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE_DIRS = ("shardc", "scripts", "tests")


def _sources() -> list[Path]:
    return [p for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py")) if p.name != "test_docs.py"]


def _code_map_rows() -> list[str]:
    """The module column of docs/architecture.md §2.1's table: one path under shardc/ per row."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("\n### 2.1 "):text.index("\n### 2.2 ")]
    return re.findall(r"^\| `([\w/]+\.py)` \|", section, re.M)


def test_code_map_has_one_row_per_module() -> None:
    """The code map is docs/architecture.md §2.1 (the README points to it): every module file under
    shardc/ has exactly one row, the facade shardc/__init__.py included; a subpackage's __init__.py
    may have one (where it holds code), and no row names a file that does not exist."""
    rows = _code_map_rows()
    assert len(rows) > 100, "docs/architecture.md §2.1's table was not found: the pattern is stale"
    files = {p.relative_to(ROOT / "shardc").as_posix() for p in (ROOT / "shardc").rglob("*.py")}
    modules = {f for f in files if Path(f).name != "__init__.py"} | {"__init__.py"}
    missing = sorted(modules - set(rows))
    twice = sorted({r for r in rows if rows.count(r) > 1})
    stale = sorted(set(rows) - files)
    assert not missing, f"docs/architecture.md §2.1 (the code map) has no row for: {missing}"
    assert not twice, f"docs/architecture.md §2.1 has more than one row for: {twice}"
    assert not stale, f"docs/architecture.md §2.1 names modules that do not exist: {stale}"


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


def test_mutmut_paths_exist():
    """`make mutants` mutates the modules `[tool.mutmut]` names: a module renamed or moved (as #44
    moved the loader) must be renamed there too, or mutmut silently tests less."""
    import tomllib

    root = Path(__file__).resolve().parents[2]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    missing = [p for p in cfg["only_mutate"] + cfg["pytest_add_cli_args_test_selection"]
               if not p.startswith("-") and not (root / p.split("::")[0]).exists()]
    assert not missing, missing
