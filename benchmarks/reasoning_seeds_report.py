"""The table of scripts/reasoning_seeds.sh: per seed, held-out accuracy base -> adapter and the mean
step reward over 10-step windows; then the mean and spread (sample std) over seeds.

    .venv/bin/python benchmarks/reasoning_seeds_report.py runs/rg-seeds [--window 10]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path


def windows(rewards: list[float], size: int) -> list[float]:
    return [statistics.fmean(rewards[i:i + size]) for i in range(0, len(rewards), size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--window", type=int, default=10)
    args = ap.parse_args()
    base, tuned, rows = [], [], []
    for run in sorted(args.out.glob("seed-*")):
        if not (run / "eval.json").is_file():
            continue
        ev = json.loads((run / "eval.json").read_text())
        metrics = list(csv.DictReader((run / "metrics.csv").open()))
        rewards = [float(r["reward_mean"]) for r in metrics]
        summary = json.loads((run / "summary.json").read_text())
        base.append(ev["base_accuracy"])
        tuned.append(ev["adapter_accuracy"])
        rows.append({"seed": run.name, "base": ev["base_accuracy"], "adapter": ev["adapter_accuracy"], "n": ev["n"],
                     "steps": len(rewards), "seconds": summary.get("seconds"),
                     "reward_windows": [round(w, 3) for w in windows(rewards, args.window)],
                     "validator": summary.get("validator"), "groups_rejected": summary.get("groups_rejected")})
    for row in rows:
        print(json.dumps(row))
    if rows:
        spread = (lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0)
        print(json.dumps({"seeds": len(rows), "base_mean": statistics.fmean(base), "base_std": spread(base),
                          "adapter_mean": statistics.fmean(tuned), "adapter_std": spread(tuned),
                          "gain_mean": statistics.fmean(t - b for t, b in zip(tuned, base))}))


if __name__ == "__main__":
    main()
