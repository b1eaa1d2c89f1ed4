"""Old lease rule against new on one scenario (issue 24's first figure): wasted share and groups trained.

    .venv/bin/python benchmarks/simulate_market.py [--scenario scale-10k] [--hours 1] [--workers N] [--seed 0]
    .venv/bin/python benchmarks/simulate_market.py --hours 0.25 --rules capacity \
        --over '{"job": {"ask_at_head": true}, "validation": {"probation_s": 0}}'    # a what-if

Runs the scenario twice, each in its own child process (side by side on 2 cores): `job.lease_rule
= "pending"` (the trainer's rule before issue 24: `leases.backlog_full` over pending groups,
leases without limit until 2 batches are pending) and `"capacity"` (the product's promise now,
`protocol.demand.open_capacity`: `(max_async_level + 1)` batches less pending groups and open
leases' prompts; a busy worker goes to another trainer with capacity at once). The goal (issue
24): wasted share <= 0.2 with groups trained per hour within 10% of the old rule's. CPU s is the
child's process time (user + system); wall s is what it took on this machine.
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
RULES = ("pending", "capacity")
WASTED_MAX, TRAINED_MIN = 0.2, 0.9


def merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, nested dicts merged."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def one(scenario: str, rule: str, hours: float, workers: int, seed: int, extra: str = "") -> dict[str, Any]:
    """Run the scenario under `rule` (with the JSON overrides `extra`) in this process; its figures."""
    from swarmrl.simulations.run import simulate
    from swarmrl.simulations.scenario import load_scenario

    over: dict[str, Any] = {"hours": hours, "seed": seed, "job": {"lease_rule": rule}}
    if workers:
        over |= {"workers": workers, "churn": {"joins_per_hour": 0.35 * workers}}
    over = merged(over, json.loads(extra or "{}"))
    sc = load_scenario(SCENARIOS / f"{scenario}.toml", over)
    c0, t0 = time.process_time(), time.monotonic()
    s = simulate(sc, None)
    return {"rule": rule, "cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - t0,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "trained_per_h": s["groups_trained"] / (s["simulated_s"] / 3600), "versions_per_h": s["versions_per_hour"],
            "generated": s["groups_generated"], "admitted": s["groups_admitted"],
            "wasted": s["wasted_share_total"], "wasted_by": s["wasted_share"],
            "reach95_p50_s": s["propagation"]["reach_95_s"]["p50"] or float("nan"),
            "busy_share": s["worker_busy_share"], "leases": s["leases_issued"],
            "expired": s["leases_expired"], "events": sum(s["events"].values())}


def child(args: argparse.Namespace, rule: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", rule, "--scenario", args.scenario, "--hours", str(args.hours),
           "--workers", str(args.workers), "--seed", str(args.seed), "--over", args.over]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one row per rule, the old rule first."""
    old = rows[0]["trained_per_h"] or 1.0
    head = ("| lease rule | wasted (stale / churn / banned / rejected) | groups trained/h | x old | versions/h "
            "| groups generated | admitted | leases | expired | worker busy share | reach-95% p50 s | CPU s | wall s |")
    lines = [head,
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["wasted_by"]
        lines.append(f"| {r['rule']} | {r['wasted']:.3f} ({w['stale']:.3f} / {w['churn']:.3f} / {w['banned']:.3f} / "
                     f"{w['rejected']:.3f}) | {r['trained_per_h']:,.0f} | {r['trained_per_h'] / old:.2f} "
                     f"| {r['versions_per_h']:.0f} | {r['generated']:,} | {r['admitted']:,} | {r['leases']:,} "
                     f"| {r['expired']:,} | {r['busy_share']:.3f} | {r['reach95_p50_s']:.0f} | {r['cpu_s']:.0f} "
                     f"| {r['wall_s']:.0f} |")
    return lines


def verdict(rows: list[dict[str, Any]]) -> str:
    """Whether the new rule meets the goal against the old one."""
    old, new = rows
    ratio = new["trained_per_h"] / (old["trained_per_h"] or 1.0)
    ok = new["wasted"] <= WASTED_MAX and ratio >= TRAINED_MIN
    return (f"goal (wasted <= {WASTED_MAX}, groups trained/h >= {TRAINED_MIN}x old): "
            f"{'met' if ok else 'NOT met'} (wasted {new['wasted']:.3f}, x{ratio:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="scale-10k")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=0, help="override the workers (and joins at 0.35 per worker-hour)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--over", default="", help="scenario overrides as JSON, for every rule (a what-if)")
    ap.add_argument("--rules", default=",".join(RULES), help="lease rules to run, the old one first")
    ap.add_argument("--one", choices=RULES, default="", help=argparse.SUPPRESS)   # a child: one rule, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.scenario, args.one, args.hours, args.workers, args.seed, args.over)))
        return
    rules = args.rules.split(",")
    with ThreadPoolExecutor(len(rules)) as pool:
        rows = list(pool.map(lambda r: child(args, r), rules))
    print(f"{args.scenario}, {args.hours:g} simulated h, seed {args.seed}" + (f", {args.workers} workers" * bool(args.workers))
          + (f", overrides {args.over}" * bool(args.over)))
    print("\n".join(table(rows)))
    if len(rows) == 2:
        print(verdict(rows))


if __name__ == "__main__":
    main()
