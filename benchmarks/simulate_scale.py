"""Wall time of `swarmrl simulate` for one simulated hour at 1k and 10k workers (100k with --big).

    .venv/bin/python benchmarks/simulate_scale.py [--big]

Scenario: simulations/scenarios/scale-10k.toml (4 trainers, 5% cheaters, high churn) with the
worker count (and joins) scaled. Goal: 10,000 workers for one simulated hour within 5 minutes.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import load_scenario

SCENARIO = Path(__file__).resolve().parents[1] / "simulations" / "scenarios" / "scale-10k.toml"


def main() -> None:
    sizes = [1000, 10_000] + ([100_000] if "--big" in sys.argv else [])
    print(f"{'workers':>8} {'wall_s':>8} {'versions':>8} {'admitted':>9} {'wasted':>7} {'reach95_p50_s':>13}")
    for n in sizes:
        sc = load_scenario(SCENARIO, {"workers": n, "churn": {"joins_per_hour": 0.35 * n}})
        t0 = time.monotonic()
        s = simulate(sc, None)
        wall = time.monotonic() - t0
        print(f"{n:>8} {wall:>8.1f} {s['versions']:>8} {s['groups_admitted']:>9} {s['wasted_share_total']:>7.3f} "
              f"{s['propagation']['reach_95_s']['p50']!s:>13}", flush=True)


if __name__ == "__main__":
    main()
