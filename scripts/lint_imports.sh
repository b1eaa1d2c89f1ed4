#!/usr/bin/env bash
# Check the import contracts in pyproject.toml ([tool.importlinter]) with import-linter.
# import-linter (grimp) finds a package's modules by walking its folder, and our sub-packages sit
# in root folders mapped by setuptools' package-dir; so it reads a temporary tree of links laid
# out as the installed package is: swarmrl/{__init__.py,node,protocol,validator,simulations}.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/swarmrl"
ln -s "$root/swarmrl/__init__.py" "$tree/swarmrl/__init__.py"
for d in node protocol validator simulations; do ln -s "$root/$d" "$tree/swarmrl/$d"; done
cd "$tree"
PYTHONPATH="$tree" "$py" -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())" --config "$root/pyproject.toml" --no-cache "$@"
