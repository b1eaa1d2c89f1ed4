#!/usr/bin/env bash
# Arithmetic on Gemma: the built-in environment vs the same task as a data-set job, over seeds
# (issue 9's comparison). Each arm: `swarmrl up` with the built-in job's settings, then
# `swarmrl eval` (200 held-out prompts, base vs adapter). Results: OUT/results.txt, one line per
# run; a finished run (OUT/KIND-SEED/eval.json) is skipped, so the script can be resumed.
#
#   bash scripts/arithmetic_seeds.sh [OUT=runs/arith-seeds] [SEEDS="0 1 2"]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-runs/arith-seeds}
SEEDS=${2:-"0 1 2"}
mkdir -p "$OUT"
[ -f "$OUT/arith/arithmetic.toml" ] || .venv/bin/python scripts/export_arithmetic.py "$OUT/arith" --model gemma --steps 60
for seed in $SEEDS; do
  for kind in dataset builtin; do
    run=$OUT/$kind-$seed
    [ -f "$run/eval.json" ] && continue
    t0=$(date +%s)
    if [ "$kind" = dataset ]; then
      .venv/bin/swarmrl up "$OUT/arith/arithmetic.toml" --seed "$seed" --no-eval --out "$run" > "$run.up.log" 2>&1
      rc=$?
      .venv/bin/swarmrl eval "$OUT/arith/arithmetic.toml" --seed "$seed" --adapter "$run/adapter" --n 200 > "$run.eval.log" 2>&1
    else
      .venv/bin/swarmrl up --model gemma --seed "$seed" --no-eval --out "$run" > "$run.up.log" 2>&1
      rc=$?
      .venv/bin/swarmrl eval --adapter "$run/adapter" --n 200 > "$run.eval.log" 2>&1
    fi
    [ "$rc" = 0 ] && tail -1 "$run.eval.log" > "$run/eval.json"
    echo "$kind seed=$seed rc=$rc secs=$(( $(date +%s) - t0 )) eval=$(tail -1 "$run.eval.log")" >> "$OUT/results.txt"
  done
done
cat "$OUT/results.txt"
