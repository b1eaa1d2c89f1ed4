#!/usr/bin/env bash
# Static checks, in order: ruff (lint and docstrings), file sizes, mypy (scripts/typecheck.sh), the import
# contracts and the import-circle check (scripts/lint_imports.sh). Stops at the first that fails.
# scripts/run_tests.sh runs this before pytest, so `make test` and CI do too.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo "== ruff"
.venv/bin/ruff check node protocol validator simulations swarmrl tests benchmarks scripts
echo "== file sizes (one concept per file: at most 450 lines of Python, generated code aside)"
big=$(git ls-files --cached --others --exclude-standard '*.py' | grep -v '^protocol/pb/' | while read -r f; do [ -f "$f" ] && n=$(wc -l <"$f") && [ "$n" -gt 450 ] && echo "$f: $n lines"; done || true)
if [ -n "$big" ]; then echo "$big"; echo "split these files (one concept per file)"; exit 1; fi
echo "== mypy"
bash scripts/typecheck.sh
echo "== import contracts, import circles"
bash scripts/lint_imports.sh
