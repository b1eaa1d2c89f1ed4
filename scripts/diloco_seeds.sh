#!/usr/bin/env bash
# Issue 26's first figure: bytes between two trainers and held-out accuracy, per-step gradient
# averaging against DiLoCo (H = inner steps), over seeds, on the built-in job. Each (mode, seed):
# `swarmrl up --trainers 2 --steps STEPS --seed S` (niced: the machine is shared), with `up`'s own
# held-out evaluation at the end. A finished run (OUT/MODE-seed-S/summary.json) is skipped, so the
# script can be resumed. The table is benchmarks/diloco_seeds_report.py OUT. MODES (environment)
# picks the arms: every_step, diloco (the job spec's outer optimizer: Nesterov, lr 0.7, momentum
# 0.9), diloco_avg (outer lr 1, momentum 0: plain averaging of the trainers' progress).
#
#   [MODES="every_step diloco"] bash scripts/diloco_seeds.sh [OUT=runs/diloco-seeds] [SEEDS="0 1 2"] [STEPS=64] [H=8] [up options...]
set -u
cd "$(dirname "$0")/.."
OUT=${1:-runs/diloco-seeds}
SEEDS=${2:-"0 1 2"}
STEPS=${3:-64}
H=${4:-8}
shift $(( $# < 4 ? $# : 4 ))
mkdir -p "$OUT"
for seed in $SEEDS; do
  for mode in ${MODES:-every_step diloco}; do
    run=$OUT/$mode-seed-$seed
    [ -f "$run/summary.json" ] && continue
    sync=(-j 'sync="every_step"')
    [ "$mode" = diloco ] && sync=(-j 'sync="diloco"' -j "inner_steps=$H")
    [ "$mode" = diloco_avg ] && sync=(-j 'sync="diloco"' -j "inner_steps=$H" -j outer_learning_rate=1.0 -j outer_momentum=0.0)
    t0=$(date +%s)
    nice -n 10 .venv/bin/swarmrl up --trainers 2 --steps "$STEPS" --seed "$seed" "${sync[@]}" --out "$run" \
      --timeout 5400 "$@" > "$run.log" 2>&1
    rc=$?
    echo "mode=$mode seed=$seed rc=$rc secs=$(( $(date +%s) - t0 )) load='$(cut -d' ' -f1-3 /proc/loadavg)' $(tail -1 "$run.log")" >> "$OUT/results.txt"
  done
done
cat "$OUT/results.txt"
