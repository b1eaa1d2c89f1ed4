"""How many audits per hour catch 99% of cooked credit statements within 10 minutes (issue 27's figure).

    .venv/bin/python benchmarks/simulate_audits.py [--scenario scale-10k] [--hours 1] [--workers N]
        [--share 0.01] [--within 600] [--trials 100] [--seed 0]

Runs the scenario once (the simulator's trainers sign a statement per version: `Metrics.statements`),
then, for each audit rule and red-team mode, audits the recorded chains at doubling rates (15, 30,
... per hour over the swarm, each audit of one random trainer) in `--trials` trials, each cooking a
fresh random `--share` of the statements (`simulations/audits.py`, the audit command's own draw:
`protocol.audit_sampling`). Prints the caught share within `--within` s at each rate until it
reaches 0.99, the least such rate per rule and mode, what one audit fetches, and how long an
omission takes to come due (caught only by the victim's own audit: see simulations/audits.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from swarmrl.protocol.red_team_modes import MISSTATED_ADAPTER, SYBIL_CREDIT
from swarmrl.simulations.audits import AuditRule, Caught, Chains, caught_within, omission_due_s, run_audits
from swarmrl.simulations.run import fewer_collections
from swarmrl.simulations.scenario import load_scenario
from swarmrl.simulations.world import World

SCENARIOS = Path(__file__).resolve().parents[1] / "simulations" / "scenarios"
RULES = (AuditRule("chain: 64 batches of the whole chain, head + 1 update (the default)"),
         AuditRule("window 10 min: 64 batches, head + 1 update", window_s=600),
         AuditRule("window 10 min: 64 batches, every kept update", adapters=None, window_s=600),
         AuditRule("window 10 min: 256 batches, every kept update", sample=256, adapters=None, window_s=600))
MODES = (SYBIL_CREDIT, MISSTATED_ADAPTER)
RATES = [15 * 2 ** k for k in range(12)]   # 15 .. 30,720 per hour
GOAL = 0.99


def statements(scenario: str, hours: float, workers: int, seed: int) -> tuple[list[tuple[float, int, int, int]], float, int]:
    """Run the scenario; its trainers' statements, the simulated seconds and max_async_level."""
    over: dict[str, object] = {"hours": hours, "seed": seed}
    if workers:
        over |= {"workers": workers, "churn": {"joins_per_hour": 0.35 * workers}}
    sc = load_scenario(SCENARIOS / f"{scenario}.toml", over)
    with fewer_collections():
        world = World(sc)
        reached = world.run(sc.seconds, lambda: False, slice_s=10.0)
    return world.metrics.statements, reached, sc.job.max_async_level


def sweep(chains: Chains, mode: str, rule: AuditRule, args: argparse.Namespace, end_s: float, a: int
          ) -> list[tuple[int, float, int]]:
    """(rate, caught share within args.within, cooked statements judged) at each rate up to the goal."""
    rows = []
    for rate in RATES:
        pooled: list[Caught] = []
        for trial in range(args.trials):
            pooled += run_audits(chains, mode, rule, rate, share=args.share, end_s=end_s,
                                 seed=args.seed * 100_003 + trial, max_async_level=a)
        share, n = caught_within(pooled, args.within, end_s)
        rows.append((rate, share, n))
        if share >= GOAL:
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="scale-10k")
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=0, help="override the workers (and joins at 0.35 per worker-hour)")
    ap.add_argument("--share", type=float, default=0.01, help="share of statements cooked")
    ap.add_argument("--within", type=float, default=600.0, help="seconds after publication")
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    c0 = time.process_time()
    sts, end_s, a = statements(args.scenario, args.hours, args.workers, args.seed)
    sim_cpu = time.process_time() - c0
    chains = Chains(sts)
    per_version = [s[3] for s in sts]
    versions = len({s[1] for s in sts})
    print(f"{args.scenario}, {args.hours:g} simulated h, seed {args.seed}"
          + (f", {args.workers} workers" * bool(args.workers))
          + f": {len(chains.ranks)} trainers, {versions} versions ({versions / (end_s / 3600):.0f}/h), "
          f"{len(sts)} statements, batches per statement median {statistics.median(per_version):.0f}; "
          f"{args.share:.0%} cooked, {args.trials} trials per rate; simulator {sim_cpu:.0f} CPU s")
    print("| audit rule | mode | audits/h | caught within "
          f"{args.within:.0f} s | cooked statements judged |")
    print("|---|---|---|---|---|")
    least: dict[tuple[str, str], int | None] = {}
    c1 = time.process_time()
    for rule in RULES:
        for mode in MODES:
            rows = sweep(chains, mode, rule, args, end_s, a)
            for rate, share, n in rows:
                print(f"| {rule.name} | {mode} | {rate:,} | {share:.3f} | {n} |", flush=True)
            least[(rule.name, mode)] = rows[-1][0] if rows and rows[-1][1] >= GOAL else None
    print(f"\naudits per hour (swarm-wide) for {GOAL:.0%} of cooked statements caught within {args.within:.0f} s:")
    for rule in RULES:
        got = [least[(rule.name, m)] for m in MODES]
        both = None if None in got else max(g for g in got if g is not None)
        cells = ", ".join(f"{m} {g:,}" if g else f"{m} > {RATES[-1]:,}" for m, g in zip(MODES, got, strict=True))
        print(f"  {rule.name}: {cells}; both: {f'{both:,}' if both else 'not within the grid'}")
    due = omission_due_s(sts, a)
    print(f"omit_groups: caught only with the victim's receipts; a group is due {statistics.median(due):.0f} s "
          f"(median; max {max(due):.0f} s) after its version, so a victim auditing its receipts every "
          f"{max(0.0, args.within - max(due)):.0f} s or less catches it within {args.within:.0f} s")
    print(f"audit model: {time.process_time() - c1:.0f} CPU s")


if __name__ == "__main__":
    main()
