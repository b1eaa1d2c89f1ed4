"""Off-policy budget: the same job on the local swarm at several max_async_level values, over seeds.

Per level and seed: `swarmrl up` (the built-in job; `--steps`, `--workers`, `--lr` override it),
then, with `--n-eval N`, the adapter's held-out greedy accuracy on N prompts (the same
`node.evaluation.heldout.evaluate` code as `swarmrl eval`, one backend for every adapter). Printed per run
and, per level, as mean ± sample std over seeds: held-out accuracy, reward over the last quarter
of steps, mean staleness (versions behind) of trained rollouts, mean normalised ESS of the
importance weights, groups rejected as stale or dropped, and wall seconds (ratio to the first
level). Runs are kept under `--out` as `async{L}-seed{S}`; one whose summary.json exists is read
back, not run again, so a study resumes, and a run made elsewhere with the same settings (for
example the swarm side of `benchmarks/vs_trl.py`, `OUT/seedS/swarm/up`) can be linked in.

    .venv/bin/python benchmarks/async_levels.py [--model tiny] [--steps 12] [--workers 2] [--lr 0.02]
    .venv/bin/python benchmarks/async_levels.py --model gemma --steps 60 --levels 0,2 --seeds 0,1,2 \\
        --n-eval 200 --out runs/async_gemma
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmrl.node.local.up import UpOptions, run_up


def run_level(level: int, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One `swarmrl up` at `level` and `seed` (or the kept run in root/async{level}-seed{seed})."""
    out = root / f"async{level}-seed{seed}"
    if not (out / "summary.json").exists():
        run_up(UpOptions(out=out, model=args.model, steps=args.steps, workers=args.workers,
                         max_async_level=level, seed=seed,
                         job_overrides={"learning_rate": args.lr} if args.lr else {}, eval_n=0))
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    ess = [float(r["ess"]) for r in rows if r.get("ess")]
    tail = [float(r["reward_mean"]) for r in rows[-max(1, len(rows) // 4):]]
    return {"level": level, "seed": seed, "steps": len(rows), "reward_last": statistics.mean(tail),
            "staleness": summary["staleness_mean"], "ess": statistics.mean(ess) if ess else math.nan,
            "stale_rejected": summary["groups_rejected"].get("stale", 0), "dropped": summary["groups_dropped"],
            "seconds": summary["seconds"], "adapter": str(out / "adapter")}


def heldout_accuracy(results: list[dict[str, Any]], model: str, n: int) -> None:
    """Add "accuracy" (and the base model's, "base_accuracy") to each result: greedy, n held-out prompts."""
    from swarmrl.node.evaluation.heldout import evaluate, load_adapter
    from swarmrl.node.inference import build_backend
    from swarmrl.node.models.base_model import prepare_base_model, resolve_model_name
    from swarmrl.protocol.envs import get_environment, heldout_prompts

    backend = build_backend("hf", prepare_base_model(resolve_model_name(model), None))
    env = get_environment("arithmetic", "1")
    prompts = heldout_prompts(env, n, 0)
    base = evaluate(backend, env, prompts, None, 8).accuracy
    for k, r in enumerate(results):
        load_adapter(backend, f"a{k}", Path(r["adapter"]))
        r["accuracy"], r["base_accuracy"] = evaluate(backend, env, prompts, f"a{k}", 8).accuracy, base
        backend.remove_adapter(f"a{k}")


def _mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "-"
    return f"{statistics.fmean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seeds", default="0", help="comma-separated job seeds")
    p.add_argument("--levels", default="0,1,2,4")
    p.add_argument("--lr", type=float, default=None, help="override the built-in job's learning rate")
    p.add_argument("--n-eval", type=int, default=0, help="held-out prompts per adapter (0: no evaluation)")
    p.add_argument("--out", type=Path, default=None, help="keep runs here (default: a temporary folder)")
    args = p.parse_args()
    levels, seeds = [int(v) for v in args.levels.split(",")], [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="swarmrl-async-") as tmp:
        root = args.out or Path(tmp)
        results = [run_level(level, seed, args, root) for level in levels for seed in seeds]
        if args.n_eval:
            heldout_accuracy(results, args.model, args.n_eval)
    print(f"\nmodel={args.model} steps={args.steps} workers={args.workers} seeds={args.seeds} "
          f"lr={args.lr or 'job default'}")
    print(f"{'level':>5} {'seed':>4} {'accuracy':>8} {'reward(last 1/4)':>17} {'staleness':>10} {'ESS':>7} "
          f"{'stale rej.':>10} {'dropped':>8} {'seconds':>8}")
    for r in results:
        print(f"{r['level']:>5} {r['seed']:>4} {r.get('accuracy', math.nan):>8.3f} {r['reward_last']:>17.3f} "
              f"{r['staleness']:>10.2f} {r['ess']:>7.3f} {r['stale_rejected']:>10} {r['dropped']:>8} "
              f"{r['seconds']:>8.1f}")
    first = statistics.fmean(r["seconds"] for r in results if r["level"] == levels[0])
    print(f"\n{'level':>5} {'held-out accuracy':>18} {'reward(last 1/4)':>17} {'ESS':>15} {'seconds':>20}")
    for level in levels:
        rs = [r for r in results if r["level"] == level]
        secs = statistics.fmean(r["seconds"] for r in rs)
        print(f"{level:>5} {_mean_sd([r.get('accuracy', math.nan) for r in rs]):>18} "
              f"{_mean_sd([r['reward_last'] for r in rs]):>17} {_mean_sd([r['ess'] for r in rs]):>15} "
              f"{secs:>8.1f} ({secs / first:.2f}x level {levels[0]})")
    if results and "base_accuracy" in results[0]:
        print(f"base model held-out accuracy {results[0]['base_accuracy']:.3f} (n={args.n_eval})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
