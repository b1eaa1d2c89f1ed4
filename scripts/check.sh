#!/usr/bin/env bash
# Static checks, in order: ruff (lint and docstrings), mypy (scripts/typecheck.sh) and the import
# contracts (scripts/lint_imports.sh). Stops at the first that fails. scripts/run_tests.sh runs
# this before pytest, so `make test` and CI do too.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
echo "== ruff"
.venv/bin/ruff check node protocol validator simulations swarmrl tests benchmarks
echo "== mypy"
bash scripts/typecheck.sh
echo "== import contracts"
bash scripts/lint_imports.sh
