"""Per-step averaging against DiLoCo for one job's trainers across data centres (issue 26, item 4):
wall time of the job, the trainers' compute utilization and the bytes between them, simulated
(`simulations/trainer_sync.py`), 3 seeds each, both sync modes in one run.

    .venv/bin/python benchmarks/simulate_trainer_sync.py                  # the bed and the regions
    .venv/bin/python benchmarks/simulate_trainer_sync.py --steps 60 --inner-steps 8 --json out.json

Cases: the slow-link bed of the issue (2 trainers, 100 ms one way, 20 Mbit/s), three trainers in
na/eu/asia at 20 Mbit/s, and each of those with one trainer lost for a minute in the middle of the
job (it comes back, downloads the state and goes on). The compute and supply figures are the
Gemma 270M CPU profile's (a 4.1 s step on 8 groups, 2.5 groups/s at each trainer); the bytes are
calibrated on the product's measured rounds (docs/DILOCO.md). Prints medians over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from swarmrl.simulations.trainer_sync import Dropout, SyncSetup, TrainerSync

SEEDS = (0, 1, 2)


def cases(steps: int) -> dict[str, dict[str, Any]]:
    """Named setups (SyncSetup keyword arguments, without `sync`)."""
    mid = steps * 4.1 * 0.4   # about 40% into a run at the step's compute pace
    return {
        "bed: 2 trainers, 100 ms, 20 Mbit/s": {"regions": ("na", "eu"), "one_way_s": 0.1, "link_mbit": 20.0},
        "3 regions (na/eu/asia), 20 Mbit/s": {"regions": ("na", "eu", "asia"), "link_mbit": 20.0},
        "bed, trainer1 lost for 60 s": {"regions": ("na", "eu"), "one_way_s": 0.1, "link_mbit": 20.0,
                                        "dropouts": (Dropout(1, mid, 60.0),)},
        "3 regions, asia lost for 60 s": {"regions": ("na", "eu", "asia"), "link_mbit": 20.0,
                                          "dropouts": (Dropout(2, mid, 60.0),)},
    }


def run_case(kw: dict[str, Any], sync: str, steps: int, h: int) -> dict[str, Any]:
    """Median figures of one setup over SEEDS."""
    runs = [TrainerSync(SyncSetup(sync=sync, steps=steps, inner_steps=h, seed=seed, **kw)).run() for seed in SEEDS]
    utils = [min(r.utilization()) for r in runs]
    return {"wall_s": statistics.median(r.wall_s for r in runs), "min_utilization": statistics.median(utils),
            "mean_utilization": statistics.median(statistics.fmean(r.utilization()) for r in runs),
            "mb_between_trainers": statistics.median(sum(r.bytes_sent) for r in runs) / 1e6,
            "rounds_met": statistics.median(r.rounds_met for r in runs), "rounds": runs[0].rounds,
            "lost_steps": statistics.median(r.lost_steps for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--inner-steps", type=int, default=8)
    ap.add_argument("--json", default="", help="also write the figures to this file")
    args = ap.parse_args()
    out: dict[str, dict[str, Any]] = {}
    print(f"{args.steps} steps, H = {args.inner_steps}, medians over seeds {SEEDS}")
    print(f"{'case':38} {'sync':10} {'wall s':>7} {'util min':>8} {'util mean':>9} {'MB between':>10} "
          f"{'rounds met':>10} {'lost steps':>10}")
    for name, kw in cases(args.steps).items():
        for sync in ("every_step", "diloco"):
            f = out.setdefault(name, {})[sync] = run_case(kw, sync, args.steps, args.inner_steps)
            print(f"{name:38} {sync:10} {f['wall_s']:7.0f} {f['min_utilization']:8.3f} {f['mean_utilization']:9.3f} "
                  f"{f['mb_between_trainers']:10.0f} {f['rounds_met']:>5.0f} of {f['rounds']:<2d} {f['lost_steps']:10.0f}")
        old, new = out[name]["every_step"], out[name]["diloco"]
        print(f"{'':38} {'ratio':10} {old['wall_s'] / new['wall_s']:6.2f}x faster, "
              f"{old['mb_between_trainers'] / max(new['mb_between_trainers'], 1e-9):.1f}x fewer bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
