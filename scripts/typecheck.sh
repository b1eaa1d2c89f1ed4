#!/usr/bin/env bash
# Type-check the package with mypy ([tool.mypy] in pyproject.toml; pydantic's plugin on).
# mypy can't follow the editable install's import hook to swarmrl.node and friends, so it checks
# `-p swarmrl` in a tree of links laid out as the installed package is (scripts/package_tree.sh).
# The tree sits at a fixed place under .cache/ so mypy's incremental cache stays valid between
# runs; reported paths are rewritten back to the checkout's (node/..., not swarmrl/node/...).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=$root/.venv/bin/python  # the venv's, whatever PYTHON says (make passes PYTHON=python3 to make the venv)
source "$root/scripts/package_tree.sh"
tree=$root/.cache/mypy-tree
package_tree "$root" "$tree"
cd "$tree"
set +e
"$py" -m mypy --config-file "$root/pyproject.toml" --cache-dir "$root/.cache/mypy" -p swarmrl "$@" \
  | sed -E 's#^swarmrl/(node|protocol|validator|simulations)/#\1/#'
status=${PIPESTATUS[0]}
exit "$status"
