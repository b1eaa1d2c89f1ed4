"""Off-policy budget: the same job and seed on the local swarm with max_async_level 0, 1, 2, 4.

Prints, per level: reward over the last steps, mean staleness (versions behind) of trained
rollouts, mean normalised ESS of the importance weights, groups dropped or rejected as stale,
and wall time. Usage:

    .venv/bin/python benchmarks/async_levels.py [--model tiny] [--steps 12] [--workers 2] [--lr 0.02]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
from pathlib import Path

from swarmrl.node.up import UpOptions, run_up


def run_level(level: int, args: argparse.Namespace, root: Path) -> dict:
    out = root / f"async{level}"
    summary = run_up(UpOptions(out=out, model=args.model, steps=args.steps, workers=args.workers,
                               max_async_level=level, seed=args.seed,
                               job_overrides={"learning_rate": args.lr} if args.lr else {}))
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    ess = [float(r["ess"]) for r in rows if r.get("ess")]
    tail = [float(r["reward_mean"]) for r in rows[-max(1, args.steps // 4):]]
    stale = summary["groups_rejected"].get("stale", 0)
    return {"level": level, "reward_last": statistics.mean(tail), "staleness": summary["staleness_mean"],
            "ess": statistics.mean(ess) if ess else float("nan"), "stale_rejected": stale,
            "dropped": summary["groups_dropped"], "seconds": summary["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--levels", default="0,1,2,4")
    p.add_argument("--lr", type=float, default=None, help="override the built-in job's learning rate")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarmrl-async-") as tmp:
        results = [run_level(int(lv), args, Path(tmp)) for lv in args.levels.split(",")]
    print(f"\nmodel={args.model} steps={args.steps} workers={args.workers} seed={args.seed} lr={args.lr or 'job default'}")
    print(f"{'max_async_level':>15} {'reward(last 1/4)':>17} {'staleness':>10} {'ESS':>7} "
          f"{'stale rej.':>10} {'dropped':>8} {'seconds':>8}")
    base = results[0]["seconds"]
    for r in results:
        print(f"{r['level']:>15} {r['reward_last']:>17.3f} {r['staleness']:>10.2f} {r['ess']:>7.3f} "
              f"{r['stale_rejected']:>10} {r['dropped']:>8} {r['seconds']:>8.1f}  ({r['seconds'] / base:.2f}x level 0)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
