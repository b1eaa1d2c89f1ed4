"""Old snapshot rule against new on one scenario (issue 24 item 5, "no snapshot herd"): the
trainers' share of snapshot bytes, failed fetches, versions/h and the wasted share.

    .venv/bin/python benchmarks/simulate_snapshots.py [--scenario scale-100k] [--hours 1] [--workers N] [--seed 0]

Runs the scenario under each variant, each in its own child process (side by side on 2 cores):
- "old": `gossip.snapshot_rule = "received"` (a peer serves only a trainer-made snapshot it received)
  with no wait for a peer's snapshot and no bound on the streams a peer serves: the simulator and
  product before issue 24 item 5;
- "new": the product's now (`protocol/snapshot_sources.py`): every peer serves its newest
  `keep_snapshots` versions as snapshots, at most `max_snapshot_streams` at once, and a joiner that
  finds none waits a random share of `peer_wait_s` for one before its trainer.
The goal (issue 24): trainers' share of snapshot bytes <= 0.2 at 100,000 workers. CPU s is the
child's process time; wall s what it took on this machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).resolve().parents[1] / "simulations" / "scenarios"
VARIANTS: dict[str, dict[str, Any]] = {
    "old": {"gossip": {"snapshot_rule": "received", "snapshot_wait": False, "max_snapshot_streams": 1_000_000,
                       "trainer_snapshot_streams": 0}},
    "new": {},
}
SHARE_MAX = 0.2


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, nested dicts merged."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def one(scenario: str, variant: str, hours: float, workers: int, seed: int) -> dict[str, Any]:
    """Run the scenario under `variant` in this process; its figures."""
    from swarmrl.simulations.run import simulate
    from swarmrl.simulations.scenario import load_scenario

    over: dict[str, Any] = {"hours": hours, "seed": seed}
    if workers:
        over |= {"workers": workers, "churn": {"joins_per_hour": 0.35 * workers}}
    sc = load_scenario(SCENARIOS / f"{scenario}.toml", merged(over, VARIANTS[variant]))
    c0, t0 = time.process_time(), time.monotonic()
    s = simulate(sc, None)
    return {"variant": variant, "cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - t0,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "snapshot_bytes": s["snapshots"]["bytes"], "trainer_share": s["snapshots"]["trainer_share"],
            "refused": s["snapshots"]["refused"], "trainer_refused": s["snapshots"]["trainer_refused"],
            "failed": s["fetches_failed"],
            "versions_per_h": s["versions_per_hour"], "wasted": s["wasted_share_total"],
            "trained_per_h": s["groups_trained"] / (s["simulated_s"] / 3600),
            "reach95_p50_s": s["propagation"]["reach_95_s"]["p50"] or float("nan"),
            "adapter_behind": s["adapter_behind"]}


def child(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", variant, "--scenario", args.scenario, "--hours", str(args.hours),
           "--workers", str(args.workers), "--seed", str(args.seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one row per variant, the old one first."""
    lines = [("| snapshot rule | trainers' share of snapshot bytes | snapshot GB peer / trainer | refused busy peer / trainer "
             "| failed fetches peer / trainer | versions/h | groups trained/h | wasted | reach-95% p50 s "
             "| CPU s | wall s |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, f = r["snapshot_bytes"], r["failed"]
        lines.append(f"| {r['variant']} | {r['trainer_share']:.3f} | {b['peer'] / 1e9:.1f} / {b['trainer'] / 1e9:.1f} "
                     f"| {r['refused']:,} / {r['trainer_refused']:,} | {f.get('peer', 0):,} / {f.get('trainer', 0):,} | {r['versions_per_h']:.0f} "
                     f"| {r['trained_per_h']:,.0f} | {r['wasted']:.3f} | {r['reach95_p50_s']:.0f} | {r['cpu_s']:.0f} "
                     f"| {r['wall_s']:.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="scale-100k")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=0, help="override the workers (and joins at 0.35 per worker-hour)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants to run, the old one first")
    ap.add_argument("--one", choices=tuple(VARIANTS), default="", help=argparse.SUPPRESS)   # a child: JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.scenario, args.one, args.hours, args.workers, args.seed)))
        return
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    with ThreadPoolExecutor(len(variants)) as pool:
        rows = list(pool.map(lambda v: child(args, v), variants))
    print(f"{args.scenario}, {args.hours:g} simulated h, seed {args.seed}" + (f", {args.workers} workers" * bool(args.workers)))
    print("\n".join(table(rows)))
    new = rows[-1]
    print(f"goal (trainers' share of snapshot bytes <= {SHARE_MAX}): "
          f"{'met' if new['trainer_share'] <= SHARE_MAX else 'NOT met'} ({new['variant']}: {new['trainer_share']:.3f})")


if __name__ == "__main__":
    main()
