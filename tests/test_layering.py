"""Imports run one way: train/, export/, serve/ -> heads/, never sideways; heads/ imports none of them; bench/ sits on
top of all four and nothing of the library imports it."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("heads", "train", "export", "serve", "bench")
ALLOWED = {"heads": {"heads"}, "train": {"heads", "train"}, "export": {"heads", "export"}, "serve": {"heads", "serve"},
           "bench": set(PACKAGES)}


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


def project_python_files() -> list[Path]:
    """The project's own .py files: what git tracks (plus new files not yet added), never a virtualenv, build or
    cache directory inside the clone, which a new user's `python3 -m venv .venv` puts there."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist): walk, minus envs
        skip = {".venv", "venv", ".venvs", "build", "dist", ".git", "node_modules"}
        return [f for f in ROOT.rglob("*.py") if not skip & set(f.relative_to(ROOT).parts)]
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_project_files_exclude_a_virtualenv_in_the_clone():
    files = project_python_files()
    assert ROOT / "tests" / "test_layering.py" in files
    assert not [f for f in files if {".venv", "site-packages"} & set(f.relative_to(ROOT).parts)]


def test_scripts_import_no_project_code_sideways():
    """scripts/ are thin tools: they may use heads/ but nothing imports them."""
    for f in project_python_files():
        if "scripts" in f.relative_to(ROOT).parts:
            continue
        tree = ast.parse(f.read_text(), filename=str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "scripts":
                pytest.fail(f"{f} imports scripts/")


def test_no_private_names_imported_across_packages():
    """A name with a leading underscore is its module's own business: another package (or a script) that needs it
    gets a public name instead. Tests may reach in: they test the module itself."""
    bad = []
    for f in project_python_files():
        home = f.relative_to(ROOT).parts[0]
        if home == "tests":
            continue
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                root = node.module.split(".")[0]
                if root in PACKAGES and root != home:
                    bad += [f"{f.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not bad, f"private names imported across packages: {bad}"
