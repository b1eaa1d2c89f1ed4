#!/usr/bin/env bash
# Issue 25 item 7: a reasoning-gym job over seeds. Each seed: `swarmrl up JOB --seed S` (niced: the
# machine is shared), then `swarmrl eval JOB --seed S` (held-out greedy accuracy, base vs adapter).
# A finished seed (OUT/seed-S/eval.json) is skipped, so the script can be resumed; a seed whose `up`
# fails is logged in OUT/results.txt and not evaluated. The table (base -> adapter per seed, mean and
# spread, 10-step reward windows) is benchmarks/reasoning_seeds_report.py.
#
#   bash scripts/reasoning_seeds.sh [JOB=examples/jobs/reasoning_chain_sum.toml] [OUT=runs/rg-seeds] [SEEDS="0 1 2"] [N=100] [-j overrides...]
set -u
cd "$(dirname "$0")/.."
JOB=${1:-examples/jobs/reasoning_chain_sum.toml}
OUT=${2:-runs/rg-seeds}
SEEDS=${3:-"0 1 2"}
N=${4:-100}
shift $(( $# < 4 ? $# : 4 ))
mkdir -p "$OUT"
for seed in $SEEDS; do
  run=$OUT/seed-$seed
  [ -f "$run/eval.json" ] && continue
  t0=$(date +%s)
  nice -n 10 .venv/bin/swarmrl up "$JOB" --seed "$seed" --no-eval --out "$run" --timeout 5400 "$@" > "$run.up.log" 2>&1
  rc=$?
  t1=$(date +%s)
  if [ "$rc" != 0 ]; then   # no adapter to evaluate: say so, and go on to the next seed
    echo "seed=$seed rc=$rc up_secs=$(( t1 - t0 )) up failed: $(tail -1 "$run.up.log")" >> "$OUT/results.txt"
    continue
  fi
  nice -n 10 .venv/bin/swarmrl eval "$JOB" --seed "$seed" --adapter "$run/adapter" --n "$N" > "$run.eval.log" 2>&1
  tail -1 "$run.eval.log" > "$run/eval.json"
  echo "seed=$seed rc=$rc up_secs=$(( t1 - t0 )) eval_secs=$(( $(date +%s) - t1 )) load='$(cut -d' ' -f1-3 /proc/loadavg)' eval=$(tail -1 "$run.eval.log")" >> "$OUT/results.txt"
done
cat "$OUT/results.txt"
