"""The product's gossip and lease defaults against the alternatives, on the simulator.

    .venv/bin/python benchmarks/simulate_defaults.py [--seeds 2] [--workers 1000] [--scenarios calm,high-churn]
        [--variants defaults|peer-attempts]

For each scenario (simulations/scenarios/NAME.toml, 1 simulated hour) and each variant, the mean
over seeds of: reach-95% time (p50 over versions, s), the trainers' share of the delta bytes
uploaded, the share of generated rollouts dropped as stale, groups trained per hour and versions
per hour, with the ratios of reach and groups/hour against the product's settings before this benchmark
("before": peer_wait_s = 1, a waiting worker asks the first holder it sees, the backlog rule
counts pending groups up to BACKLOG_BATCHES = 2). The variants:

- peer_wait_s = N: the worker config's wait for a peer, the product's catch-up otherwise;
- wait whole N: the "fixed-whole" wait rule (`delta_sources.waits_whole`): a waiting worker reads
  the holder records only when its random wait ends and asks a random one of them ("fixed" stops
  at the first record it sees, so every waiting worker asks that one holder: most time out after
  30 s and go to the trainer);
- open leases xB: the backlog rule counts the unanswered prompts of open leases as well as the
  pending groups (`leases.backlog_full`), refusing past B batches.

All of these ask every announced holder of an update before the trainer (max_peer_attempts = 0,
the rule before issue 13). `--variants peer-attempts` compares that rule with at most N peer
fetches per update before the trainer (worker config `max_peer_attempts`,
`protocol/delta_sources.MAX_PEER_ATTEMPTS`), the other settings as "before". `--variants
wait-rule` compares the product's wait rules for a holder (`CatchUp(wait_rule=)`, worker config
`wait_rule`, `delta_sources.WAIT_RULES`): "fixed" against "scaled" (`delta_sources.wait_ceiling_s`:
peer_wait_s * log2(previous version's holders / 128)), "scaled-whole" (the scaled ceiling, waited
whole, then a random holder: `delta_sources.waits_whole`) and "fixed-whole". `--workers` scales a scenario's joins with it; the local-* scenarios
keep their size (`--workers 0`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "simulations" / "scenarios"

BEFORE = {"gossip": {"peer_wait_s": 1.0, "max_peer_attempts": 0, "wait_rule": "fixed"},
          "job": {"lease_rule": "pending", "backlog_counts_open": False, "backlog_batches": 2}}


def variant(gossip: dict[str, Any] | None = None, job: dict[str, Any] | None = None) -> dict[str, Any]:
    """The product's settings before this benchmark (BEFORE) with `gossip` and `job` changed."""
    return {"gossip": {**BEFORE["gossip"], **(gossip or {})}, "job": {**BEFORE["job"], **(job or {})}}


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("before: peer_wait_s=1, pending x2", variant()),
    *[(f"peer_wait_s={n}", variant({"peer_wait_s": float(n)})) for n in (5, 15, 30)],
    *[(f"wait whole {n}", variant({"peer_wait_s": float(n), "wait_rule": "fixed-whole"})) for n in (10, 15)],
    *[(f"open leases x{b}", variant(job={"backlog_counts_open": True, "backlog_batches": b})) for b in (2, 4)],
]

PEER_ATTEMPTS: list[tuple[str, dict[str, Any]]] = [
    ("every holder (before)", variant()),
    *[(f"max_peer_attempts={n}", variant({"max_peer_attempts": n})) for n in (1, 2, 3, 4, 8, 16)],
]

WAIT_RULE: list[tuple[str, dict[str, Any]]] = [   # "RULE N": wait_rule RULE, peer_wait_s N
    ("fixed 1 (before)", variant()),
    *[(f"scaled {n}", variant({"wait_rule": "scaled", "peer_wait_s": float(n)})) for n in (1, 5)],
    *[(f"scaled-whole {n}", variant({"wait_rule": "scaled-whole", "peer_wait_s": float(n)})) for n in (1, 2, 5)],
    ("fixed-whole 15", variant({"wait_rule": "fixed-whole", "peer_wait_s": 15.0})),
]

VARIANT_SETS = {"defaults": VARIANTS, "peer-attempts": PEER_ATTEMPTS, "wait-rule": WAIT_RULE}


def figures(s: dict[str, Any]) -> dict[str, float]:
    """The compared figures of one run's summary (reach_95_s: p50 over versions, s)."""
    hours = s["simulated_s"] / 3600
    reach = s["propagation"]["reach_95_s"]["p50"]
    return {"reach_95_s": reach if reach is not None else float("inf"),
            "trainer_share": 1 - s["bytes"]["peer_share"],
            "stale_share": s["wasted_share"]["stale"],
            "trained_per_h": s["groups_trained"] / hours,
            "versions_per_h": s["versions"] / hours,
            "steps_per_min": s["steps_per_minute"],
            "failed_per_version": sum(s["fetches_failed"].values()) / max(1, s["versions"])}


def run_variant(scenario: str, workers: int, seeds: int, top: dict[str, Any], first_seed: int = 0) -> dict[str, float]:
    """Mean figures of `scenario` at `workers` workers with `top` overrides over `seeds` seeds
    (first_seed, first_seed + 1, ...)."""
    rows = []
    for seed in range(first_seed, first_seed + seeds):
        over = {**top, "seed": seed, **({"workers": workers} if workers else {})}
        sc = load_scenario(SCENARIOS / f"{scenario}.toml", over)
        if sc.churn.joins_per_hour and workers:
            sc = load_scenario(SCENARIOS / f"{scenario}.toml",
                               {**over, "churn": {"joins_per_hour": sc.churn.joins_per_hour * workers / 1000}})
        rows.append(figures(simulate(sc, None)))
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--scenarios", default="calm,high-churn")
    ap.add_argument("--variants", choices=sorted(VARIANT_SETS), default="defaults")
    ap.add_argument("--only", default="", help="comma-separated variant names of the set to run (default: all)")
    args = ap.parse_args()
    variants = [(n, v) for n, v in VARIANT_SETS[args.variants] if not args.only or n in args.only.split(",")]
    for scenario in args.scenarios.split(","):
        print(f"\n{scenario}, {args.workers} workers, 1 simulated hour, mean of {args.seeds} seeds "
              f"from {args.first_seed}")
        print("| variant | reach-95% p50 s | x default | trainer upload share | stale share | groups trained/h "
              "| x default | versions/h | steps/min | failed fetches/version | CPU s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        base: dict[str, float] = {}
        for name, top in variants:
            t0 = time.process_time()
            f = run_variant(scenario, args.workers, args.seeds, top, args.first_seed)
            base = base or f
            print(f"| {name} | {f['reach_95_s']:.0f} | {f['reach_95_s'] / base['reach_95_s']:.2f} "
                  f"| {f['trainer_share']:.3f} | {f['stale_share']:.3f} | {f['trained_per_h']:,.0f} "
                  f"| {f['trained_per_h'] / base['trained_per_h']:.2f} | {f['versions_per_h']:.1f} "
                  f"| {f['steps_per_min']:.1f} "
                  f"| {f['failed_per_version']:.1f} | {time.process_time() - t0:.0f} |", flush=True)


if __name__ == "__main__":
    main()
