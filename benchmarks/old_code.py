"""The package at an older commit, for benchmarks that run the old and the new code in one run."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OLD_REF = "7a25018"   # main before issue 11's server and admission work


def old_tree(ref: str, into: Path) -> Path:
    """The package at `ref` laid out as installed (swarmrl/{node,protocol,...}) under `into`;
    returns the folder to put on PYTHONPATH."""
    src = into / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "swarmrl", "node", "protocol", "validator",
                              "simulations"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    tree = into / "tree" / "swarmrl"
    tree.mkdir(parents=True)
    (tree / "__init__.py").symlink_to(src / "swarmrl" / "__init__.py")
    for d in ("node", "protocol", "validator", "simulations"):
        (tree / d).symlink_to(src / d)
    return tree.parent
