"""Many jobs on one swarm, the rules before issue 24 against the product's now (issue 24's second
figure): wasted share, groups trained, fairness over weighted fair shares, workers' moves.

    .venv/bin/python benchmarks/simulate_jobs.py [--scenario market-50] [--hours 1] [--seed 0] [--over JSON]

Runs a market scenario (`market.jobs`) twice, each in its own child process (side by side on 2
cores):
- "before": `market.choice = "walk"` (a worker walks every live job in turn, one lease each,
  whatever it needs) and `job.lease_rule = "pending"` (a trainer leases without limit until 2
  batches are pending);
- "now": `"demand"` (`protocol.market.choose_job` over the records' capacity, intake and weight;
  a busy refusal sends the worker to another job at once) and `"capacity"` (the promise,
  `protocol.demand.open_capacity`).
The goals (issue 24): wasted <= 0.1; each job's groups trained per hour >= 0.9x its weighted fair
share (`protocol.market.fair_split` of what the swarm trained among the jobs' step-bound demands:
`simulations/market_figures.py`); Jain's index over those ratios >= 0.95. A step-bound demand
overstates what a small job can take (its window of (max_async_level + 1) batches turns over once
per lease round trip and probation); `--alone-hours H` also runs one job of each class alone on
the same workers and gives the fairness against fair shares of those measured demands. CPU s is
the child's process time; wall s what it took on this machine.
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

from swarmrl.protocol.market import fair_split, jain

SCENARIOS = Path(__file__).resolve().parents[1] / "simulations" / "scenarios"
RULES = {"before": {"market": {"choice": "walk"}, "job": {"lease_rule": "pending"}},
         "now": {"market": {"choice": "demand"}, "job": {"lease_rule": "capacity"}}}
WASTED_MAX, RATIO_MIN, JAIN_MIN = 0.1, 0.9, 0.95


def one(scenario: str, rules: str, hours: float, seed: int, extra: str = "") -> dict[str, Any]:
    """Run the scenario under `rules` (with the JSON overrides `extra`) in this process; its figures."""
    from swarmrl.simulations.run import simulate
    from swarmrl.simulations.scenario import _merge, load_scenario

    over = _merge({"hours": hours, "seed": seed, **RULES[rules]}, json.loads(extra or "{}"))
    sc = load_scenario(SCENARIOS / f"{scenario}.toml", over)
    c0, t0 = time.process_time(), time.monotonic()
    s = simulate(sc, None)
    return {"rules": rules, "cpu_s": time.process_time() - c0, "wall_s": time.monotonic() - t0,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **s}


def child(args: argparse.Namespace, rules: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--one", rules, "--scenario", args.scenario, "--hours", str(args.hours),
           "--seed", str(args.seed), "--over", args.over]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown table: one row per rule set, the first (the rules before, by default) the baseline."""
    old = rows[0]["groups_trained_per_hour"] or 1
    head = ("| rules | wasted (stale / churn / banned / rejected) | groups trained/h | x before | Jain | "
            "min ratio to fair | jobs < 0.9 | starved | served > 1 job | switches / worker-h | worker busy | "
            "snapshot bytes from trainers | CPU s |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w, f, wk = r["wasted_share"], r["fairness"], r["workers"]
        lines.append(
            f"| {r['rules']} | {r['wasted_share_total']:.3f} ({w['stale']:.3f} / {w['churn']:.3f} / {w['banned']:.3f} / "
            f"{w['rejected']:.3f}) | {r['groups_trained_per_hour']:,} | {r['groups_trained_per_hour'] / old:.2f} | "
            f"{f['jain_over_fair_share_ratios']:.3f} | {f['ratio_min']} | {f['jobs_below_0_9']} | {f['jobs_starved']} | "
            f"{wk['served_more_than_one_job']:.2f} | {wk['switches_per_worker_hour']:.0f} | {wk['busy_share']:.3f} | "
            f"{r['bytes']['snapshot_trainer_share']:.3f} | {r['cpu_s']:.0f} |")
    return lines


def by_class(r: dict[str, Any]) -> list[str]:
    """Per class of jobs (weight, batch): mean groups trained/h, fair share/h and their ratio."""
    classes: dict[tuple[float, int], list[dict[str, Any]]] = {}
    for j in r["per_job"]:
        classes.setdefault((j["weight"], j["batch_groups"]), []).append(j)
    out = []
    for (weight, batch), js in classes.items():
        n = len(js)
        out.append(f"  {r['rules']}: {n} jobs of weight {weight:g}, batch {batch}: trained/h "
                   f"{sum(j['groups_trained_per_hour'] for j in js) / n:,.0f}, fair {sum(j['fair_share_per_hour'] for j in js) / n:,.0f}, "
                   f"step-bound demand {js[0]['demand_per_hour']:,}, versions {sum(j['versions'] for j in js) / n:.0f}")
    return out


def classes(row: dict[str, Any]) -> list[tuple[float, int, int]]:
    """The (weight, batch_groups, trainers) classes of a run's jobs, in order of appearance."""
    return list(dict.fromkeys((j["weight"], j["batch_groups"], j["trainers"]) for j in row["per_job"]))


def alone(args: argparse.Namespace, cls: tuple[float, int, int]) -> float:
    """Groups trained per hour by one job of class `cls` with the scenario's workers to itself
    (the product's rules, `--alone-hours`): what such a job can consume, its demand."""
    weight, batch, trainers = cls
    over = json.loads(args.over or "{}")
    over["market"] = {**over.get("market", {}), "jobs": [{"count": 1, "weight": weight, "batch_groups": batch,
                                                          "trainers": trainers}]}
    sub = argparse.Namespace(**{**vars(args), "hours": args.alone_hours, "over": json.dumps(over)})
    return float(child(sub, "now")["groups_trained_per_hour"])


def refair(row: dict[str, Any], demand: dict[tuple[float, int, int], float]) -> dict[str, Any]:
    """The row's fairness against fair shares of the jobs' measured demand (`alone`)."""
    jobs = {j["job"]: j for j in row["per_job"]}
    need = {k: demand[(j["weight"], j["batch_groups"], j["trainers"])] for k, j in jobs.items()}
    fair = fair_split(sum(j["groups_trained_per_hour"] for j in jobs.values()), need,
                      {k: j["weight"] for k, j in jobs.items()})
    ratio = [jobs[k]["groups_trained_per_hour"] / fair[k] for k in jobs if fair[k] > 0]
    return {"jain": jain(ratio), "ratio_min": min(ratio), "below_0_9": sum(r < RATIO_MIN for r in ratio)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="market-50")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--over", default="", help="JSON overrides for both runs")
    ap.add_argument("--alone-hours", type=float, default=0.0, help="also measure each class of jobs alone this "
                    "long (its demand) and give the fairness against fair shares of those demands")
    ap.add_argument("--rules", default=",".join(RULES), help="the rule sets to run, comma-separated "
                    f"(default: {','.join(RULES)}); '--rules now --alone-hours 1' measures the product's fairness alone")
    ap.add_argument("--one", choices=tuple(RULES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.scenario, args.one, args.hours, args.seed, args.over)))
        return
    names = args.rules.split(",")
    if not names or any(n not in RULES for n in names):
        ap.exit(2, f"simulate_jobs: --rules {args.rules!r}: give some of {', '.join(RULES)}, comma-separated\n")
    with ThreadPoolExecutor(2) as pool:
        rows = list(pool.map(lambda r: child(args, r), names))
    print(f"{args.scenario}, {args.hours:g} simulated h, seed {args.seed}, {rows[0]['jobs']} jobs, "
          f"{rows[0]['workers_total']:,} workers in all")
    print("\n".join(table(rows)))
    for r in rows:
        print("\n".join(by_class(r)))
    if args.alone_hours > 0:
        with ThreadPoolExecutor(2) as pool:
            demand = dict(zip(classes(rows[0]), pool.map(lambda c: alone(args, c), classes(rows[0])), strict=True))
        each = ", ".join(f"weight {w:g} batch {b} x{t} trainers: {d:,.0f}" for (w, b, t), d in demand.items())
        print(f"demand (one job of the class alone, groups trained/h, {args.alone_hours:g} h): {each}")
        for r in rows:
            f = refair(r, demand)
            print(f"  {r['rules']}: against those: Jain {f['jain']:.3f}, min ratio {f['ratio_min']:.3f}, "
                  f"jobs < 0.9: {f['below_0_9']}")
    now = rows[-1]
    met = {"wasted <= 0.1": now["wasted_share_total"] <= WASTED_MAX,
           "every job >= 0.9x fair": now["fairness"]["jobs_below_0_9"] == 0,
           "Jain >= 0.95": now["fairness"]["jain_over_fair_share_ratios"] >= JAIN_MIN}
    print(f"goals ({now['rules']}): " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in met.items()))


if __name__ == "__main__":
    main()
