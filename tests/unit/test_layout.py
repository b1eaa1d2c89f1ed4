"""The package layout: every folder with an __init__.py installs (pyproject's packages list), and
the import-circle check (scripts/import_cycles.py) finds circles and nothing else."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cycles_module():   # scripts/ is no package: load the file itself
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("import_cycles", module)
    spec.loader.exec_module(module)
    return module


def test_every_package_folder_is_installed() -> None:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    dirs = {f"swarmrl.{pkg}": ROOT / folder for pkg, folder in
            ((k.removeprefix("swarmrl.").removeprefix("swarmrl"), v) for k, v in tool["package-dir"].items())
            if pkg}
    found = {"swarmrl"}
    for name, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert found == listed


def test_no_top_level_modules_beside_node_folders() -> None:
    loose = sorted(p.name for p in (ROOT / "node").glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"node/ holds folders by concern only: move {loose} into one"


def test_strongly_connected_finds_circles_only() -> None:
    scc = _cycles_module().strongly_connected
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set(), "f": {"g"}, "g": {"f"}}
    assert sorted(scc(set(edges), edges)) == [["a", "b", "c"], ["f", "g"]]
    chain = {str(i): {str(i + 1)} for i in range(2000)}   # deep chains: no recursion limit
    assert scc(set(chain) | {"2000"}, chain) == []
