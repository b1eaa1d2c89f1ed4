#!/usr/bin/env bash
# Check the import contracts in pyproject.toml ([tool.importlinter]) with import-linter, then that no
# two of our files import each other in a circle (scripts/import_cycles.py).
# import-linter (grimp) finds a package's modules by walking its folder, so it reads a temporary
# tree of links laid out as the installed package is (scripts/package_tree.sh says why).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python  # the venv's, whatever PYTHON says (make passes PYTHON=python3 to make the venv)
source "$root/scripts/package_tree.sh"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
package_tree "$root" "$tree"
cd "$tree"
PYTHONPATH="$tree" "$py" -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())" --config "$root/pyproject.toml" --no-cache "$@"
PYTHONPATH="$tree" "$py" "$root/scripts/import_cycles.py" swarmrl
