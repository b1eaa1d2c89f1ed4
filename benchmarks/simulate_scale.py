"""Cost of `swarmrl simulate` for one simulated hour at 1k and 10k workers (100k with --big).

    .venv/bin/python benchmarks/simulate_scale.py [--sizes 1000,10000,100000] [--hours 1] [--wait-rule fixed]

Scenario: simulations/scenarios/scale-10k.toml (4 trainers, 5% cheaters, high churn) with the
worker count (and joins) scaled. Goal: 10,000 workers for one simulated hour within 5 minutes of
wall time on 2 cores. Each size runs in its own child process, so its peak memory (max RSS) is its
own; CPU-s is the child's process time (user + system), the figure to quote on a shared machine,
wall s is what it took there. Events: SimPy's (processes' steps, timeouts) plus the gossip's
(decisions, announcements, wait ends, retries).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SCENARIO = Path(__file__).resolve().parents[1] / "simulations" / "scenarios" / "scale-10k.toml"


def one(workers: int, hours: float, wait_rule: str = "") -> dict[str, float]:
    """Run one size in this process (`wait_rule`: the workers' rule, "" the default); its figures."""
    from swarmrl.simulations.run import simulate
    from swarmrl.simulations.scenario import load_scenario

    over: dict[str, object] = {"workers": workers, "hours": hours, "churn": {"joins_per_hour": 0.35 * workers}}
    if wait_rule:
        over["gossip"] = {"wait_rule": wait_rule}
    sc = load_scenario(SCENARIO, over)
    c0, t0 = time.process_time(), time.monotonic()
    s = simulate(sc, None)
    cpu, wall = time.process_time() - c0, time.monotonic() - t0
    events = sum(s["events"].values())
    return {"workers": workers, "cpu_s": cpu, "wall_s": wall, "events": events, "events_per_cpu_s": events / cpu,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "versions": s["versions"],
            "admitted": s["groups_admitted"], "wasted": s["wasted_share_total"],
            "reach95_p50_s": s["propagation"]["reach_95_s"]["p50"] or float("nan"),
            "failed_fetches": sum(s["fetches_failed"].values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000")
    ap.add_argument("--big", action="store_true", help="add 100,000 workers")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--wait-rule", default="", help="the workers' wait rule (delta_sources.WAIT_RULES; default: WAIT_RULE)")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)   # a child: one size, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.hours, args.wait_rule)))
        return
    sizes = [int(n) for n in args.sizes.split(",")] + ([100_000] if args.big else [])
    print("| workers | CPU s / simulated h | wall s | events | events per CPU s | peak MB | versions | "
          "groups admitted | wasted | reach-95% p50 s | failed fetches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--hours", str(args.hours),
                              "--wait-rule", args.wait_rule],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {n:,} | {r['cpu_s'] / args.hours:.1f} | {r['wall_s']:.0f} | {r['events']:,} "
              f"| {r['events_per_cpu_s']:,.0f} | {r['peak_mb']:.0f} | {r['versions']} | {r['admitted']:,} "
              f"| {r['wasted']:.3f} | {r['reach95_p50_s']:.0f} | {r['failed_fetches']:,} |", flush=True)


if __name__ == "__main__":
    main()
