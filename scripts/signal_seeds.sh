#!/usr/bin/env bash
# Issue 25 item 3's figure: the zero-variance share of generated tokens and held-out accuracy per
# worker CPU-hour, the current lease rule (every prompt index in order) against `lease_filter =
# "signal"` (pass over most prompts whose last group had all-equal rewards), over seeds, on the
# built-in job (Gemma 270M arithmetic: its prompts come from a few hundred problems, so they recur).
# Each (rule, seed): `swarmrl up --steps STEPS --seed S` (niced), with `up`'s own held-out
# evaluation. A finished run (OUT/RULE-seed-S/summary.json) is skipped, so the script can be
# resumed. The table is benchmarks/signal_seeds_report.py OUT.
#
#   bash scripts/signal_seeds.sh [OUT=runs/signal-seeds] [SEEDS="0 1 2"] [STEPS=60] [up options...]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-runs/signal-seeds}
SEEDS=${2:-"0 1 2"}
STEPS=${3:-60}
shift $(( $# < 3 ? $# : 3 ))
mkdir -p "$OUT"
for seed in $SEEDS; do
  for rule in ${RULES:-none signal}; do
    run=$OUT/$rule-seed-$seed
    [ -f "$run/summary.json" ] && continue
    t0=$(date +%s)
    nice -n 10 .venv/bin/swarmrl up --steps "$STEPS" --seed "$seed" -j "lease_filter=\"$rule\"" --out "$run" \
      --timeout 5400 "$@" > "$run.log" 2>&1
    rc=$?
    echo "rule=$rule seed=$seed rc=$rc secs=$(( $(date +%s) - t0 )) load='$(cut -d' ' -f1-3 /proc/loadavg)' $(tail -1 "$run.log")" >> "$OUT/results.txt"
  done
done
cat "$OUT/results.txt"
