"""The table of scripts/diloco_seeds.sh: per (mode, seed), the bytes the trainers sent each other
(scaled to 60 steps), held-out accuracy base -> adapter, wall seconds, the trainers' agreement,
their outer/averaging rounds and compute utilization (step time less round waits, over step time); then per mode the mean and spread (sample std) over seeds, and the
bytes ratio every_step / diloco.

    .venv/bin/python benchmarks/diloco_seeds_report.py runs/diloco-seeds [--per-steps 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} (std {sd:.3f}, n={len(xs)})"


def row(run: Path, per_steps: int) -> dict[str, Any]:
    """One run's figures from its summary.json."""
    s = json.loads((run / "summary.json").read_text())
    steps = int(s.get("final_version") or s.get("steps") or 0) or 1
    trainers = s.get("trainer_adapters", {})
    return {"run": run.name, "steps": steps, "sync_bytes": int(s.get("trainer_sync_bytes", 0)),
            "sync_bytes_per_60": int(s.get("trainer_sync_bytes", 0)) * per_steps / steps,
            "base": s.get("heldout_accuracy_base"), "adapter": s.get("heldout_accuracy_adapter"),
            "seconds": s.get("seconds"), "agree": s.get("adapter_hash_agreement"),
            "reward_first_last": (s.get("reward_first"), s.get("reward_last")),
            "validator": s.get("validator"), "groups_rejected": s.get("groups_rejected"),
            "rounds": {t[:8]: (v.get("averaging_rounds"), v.get("outer_rounds"), v.get("state_syncs"))
                       for t, v in trainers.items()},
            "utilization": [v.get("compute_utilization") for v in trainers.values()],
            "round_wait_s": [round(v.get("round_wait_seconds") or 0.0, 1) for v in trainers.values()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--per-steps", type=int, default=60)
    args = ap.parse_args()
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(args.out.glob("*-seed-*")):
        if (run / "summary.json").is_file():
            r = row(run, args.per_steps)
            print(json.dumps(r))
            by_mode.setdefault(run.name.split("-seed-")[0], []).append(r)
    for mode, rows in by_mode.items():
        print(f"{mode}: bytes per {args.per_steps} steps {_spread([r['sync_bytes_per_60'] for r in rows])}; "
              f"held-out base {_spread([r['base'] for r in rows if r['base'] is not None])} -> adapter "
              f"{_spread([r['adapter'] for r in rows if r['adapter'] is not None])}; seconds "
              f"{_spread([r['seconds'] for r in rows if r['seconds'] is not None])}; compute utilization "
              f"{_spread([u for r in rows for u in r['utilization'] if u is not None])}; "
              f"hashes agree {sum(bool(r['agree']) for r in rows)}/{len(rows)}")
    if by_mode.get("every_step") and by_mode.get("diloco"):
        old = statistics.fmean(r["sync_bytes_per_60"] for r in by_mode["every_step"])
        new = statistics.fmean(r["sync_bytes_per_60"] for r in by_mode["diloco"])
        print(f"bytes between trainers, every_step / diloco: {old / new:.1f}x" if new else "diloco sent no bytes")


if __name__ == "__main__":
    main()
