"""Imports run one way: train/, export/, serve/ -> heads/, never sideways; heads/ imports none of them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("heads", "train", "export", "serve")
ALLOWED = {"heads": {"heads"}, "train": {"heads", "train"}, "export": {"heads", "export"}, "serve": {"heads", "serve"}}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_flow_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    if package == "heads":
        assert files, "heads/ has no python files"
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(f) - ALLOWED[package]) for f in files}
    assert not {f: r for f, r in bad.items() if r}, f"sideways imports: {bad}"


def test_scripts_import_no_project_code_sideways():
    """scripts/ are thin tools: they may use heads/ but nothing imports them."""
    for f in ROOT.rglob("*.py"):
        if "scripts" in f.parts or ".venvs" in f.parts:
            continue
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "scripts":
                pytest.fail(f"{f} imports scripts/")
