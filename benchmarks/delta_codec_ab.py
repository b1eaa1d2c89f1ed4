"""Learning with quantised deltas: the same job on the local swarm with each delta codec, over seeds.

Runs `swarmrl up` once per (codec, seed) and prints, per run: reward over the first and last
steps, delta bytes per version (and as a share of the base model's bytes), whether every
replica's adapter hash agreed, and wall time; then per codec the mean and spread (min..max) of
the last-steps reward over seeds. `--eval N` adds held-out greedy accuracy of each run's adapter
(`swarmrl eval`, N prompts). Usage:

    .venv/bin/python benchmarks/delta_codec_ab.py [--model tiny] [--steps 12] [--seeds 0,1] \\
        [--codecs int4,float32] [--lr 0.02] [--eval 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmrl.node.local.up import UpOptions, run_up


def run_one(codec: str, seed: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / f"{codec}-s{seed}"
    overrides: dict[str, Any] = {"delta_codec": codec}
    if args.lr:
        overrides["learning_rate"] = args.lr
    s = run_up(UpOptions(out=out, model=args.model, steps=args.steps, workers=args.workers, seed=seed,
                         job_overrides=overrides, eval_n=0))
    row = {"codec": codec, "seed": seed, "reward_first": s["reward_first"], "reward_last": s["reward_last"],
           "delta_bytes": s["delta_bytes_per_version"], "base_bytes": s["base_model_bytes"],
           "agree": s["adapter_hash_agreement"], "seconds": s["seconds"], "accuracy": None}
    if args.eval:
        row["accuracy"] = _accuracy(out / "adapter", args)
    return row


def _accuracy(adapter: Path, args: argparse.Namespace) -> float:
    from swarmrl.node.evaluation.heldout import run_eval

    _, tuned = run_eval(adapter, n=args.eval)
    return float(tuned.accuracy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--codecs", default="int4,float32")
    p.add_argument("--lr", type=float, default=None, help="override the built-in job's learning rate")
    p.add_argument("--eval", type=int, default=0, help="held-out prompts to score each adapter on (0: none)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="swarmrl-codec-") as tmp:
        rows = [run_one(c, s, args, Path(tmp)) for c in args.codecs.split(",") for s in seeds]
    print(f"\nmodel={args.model} steps={args.steps} workers={args.workers} lr={args.lr or 'job default'}")
    print(f"{'codec':>8} {'seed':>4} {'reward first':>12} {'reward last':>11} {'delta B':>10} {'% base':>7} "
          f"{'agree':>5} {'accuracy':>8} {'seconds':>7}")
    for r in rows:
        acc = "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}"
        print(f"{r['codec']:>8} {r['seed']:>4} {r['reward_first']:>12.3f} {r['reward_last']:>11.3f} "
              f"{r['delta_bytes']:>10} {100 * r['delta_bytes'] / r['base_bytes']:>6.3f}% {r['agree']!s:>5} "
              f"{acc:>8} {r['seconds']:>7.0f}")
    for codec in args.codecs.split(","):
        last = [r["reward_last"] for r in rows if r["codec"] == codec]
        print(f"{codec:>8}: reward last mean {statistics.mean(last):.3f}, seeds' spread {min(last):.3f}..{max(last):.3f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
