"""The README's scenario table: each of simulations/scenarios/NAME.toml for its simulated hour.

    .venv/bin/python benchmarks/simulate_scenarios.py [--scenarios calm,high-churn,...] [--seed 0]

One row per scenario (the same figures `swarmrl simulate --scenario ... --out DIR` writes to
summary.json), then trainer-loss's before/after table when it is among them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "simulations" / "scenarios"
DEFAULT = "calm,high-churn,cheaters-5,cheaters-20,slow-region,trainer-loss"


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f}"


def row(name: str, s: dict[str, Any], cpu_s: float) -> str:
    """One markdown row of the scenario table."""
    p, w = s["propagation"], s["wasted_share"]
    reach = " / ".join(_s(p[f"reach_{q}_s"]["p50"]) for q in ("50", "95", "99"))
    cheat = s["cheaters"]
    banned, submitted = sum(r["banned"] for r in cheat.values()), sum(r["submitted"] for r in cheat.values())
    to_ban = sorted(r["to_ban_s_p50"] for r in cheat.values() if r["to_ban_s_p50"] is not None)
    cheaters = f"{banned}/{submitted}, {to_ban[len(to_ban) // 2]:.0f}" if to_ban else "-"
    failed, queue = s["fetches_failed"], s["uplink_queue_s_max"]
    return (f"| {name} | {s['versions_per_hour']:.0f} | {reach} | {_s(p['reach_95_s']['p95'])} "
            f"| {s['bytes']['trainer_upload_per_version_mean'] / 1e9:.1f} | {s['bytes']['peer_share']:.3f} "
            f"| {s['wasted_share_total']:.2f} ({w['stale']:.2f} / {w['churn']:.3f} / {w['banned']:.3f}) "
            f"| {cheaters} | {s['honest_banned']} | {s['trainer_ingest_groups_per_s']['mean']:.1f} "
            f"| {failed.get('peer', 0)} / {failed.get('trainer', 0)} | {queue.get('peer', 0):.0f} | {cpu_s:.0f} |")


def loss_table(s: dict[str, Any]) -> list[str]:
    """trainer-loss's before/after rows."""
    out = ["| part | versions/h | groups trained/h | reach 95% p50 s | trainer bytes/version | failed fetches |",
           "|---|---|---|---|---|---|"]
    for part in ("before", "after"):
        r = s["trainer_loss"][part]
        out.append(f"| {part} | {r['versions_per_hour']} | {r['groups_trained_per_hour']:,} | {r['reach_95_s_p50']} "
                   f"| {r['trainer_upload_per_version'] / 1e9:.1f} GB | {r['failed_fetches']:,} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=DEFAULT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print("| scenario | versions/h | reach 50% / 95% / 99% (p50 s) | reach 95% p95 s | trainer GB/version "
          "| peers' share | wasted (stale / churn / banned) | cheaters banned / submitted, to-ban p50 s "
          "| honest banned | ingest groups/s/trainer | failed fetches | peer queue s | CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    loss = None
    for name in args.scenarios.split(","):
        t0 = time.process_time()
        s = simulate(load_scenario(SCENARIOS / f"{name}.toml", {"seed": args.seed}), None)
        print(row(name, s, time.process_time() - t0), flush=True)
        loss = s if s["trainer_loss"] else loss
    if loss is not None:
        print("\n" + "\n".join(loss_table(loss)))


if __name__ == "__main__":
    main()
