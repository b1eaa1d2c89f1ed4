"""The table of scripts/signal_seeds.sh (issue 25 item 3's figure): per (rule, seed), the share of
admitted completion tokens in zero-variance groups, held-out accuracy base -> adapter, the honest
workers' CPU seconds and the accuracy gained per worker CPU-hour; then per rule the mean and
spread (sample std) over seeds, and the ratios of the "signal" rule to "none".

    .venv/bin/python benchmarks/signal_seeds_report.py runs/signal-seeds
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _spread(xs: list[float]) -> str:
    if not xs:
        return "-"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} (std {sd:.3f}, n={len(xs)})"


def row(run: Path) -> dict[str, Any]:
    """One run's figures from its summary.json."""
    s = json.loads((run / "summary.json").read_text())
    cpu = sum(float(v or 0.0) for v in (s.get("worker_cpu_s") or {}).values())
    base, adapter = s.get("heldout_accuracy_base"), s.get("heldout_accuracy_adapter")
    gain = adapter - base if base is not None and adapter is not None else None
    return {"run": run.name, "zero_variance_token_share": s.get("zero_variance_token_share"),
            "tokens_admitted": s.get("tokens_admitted"), "prompts_skipped": s.get("prompts_skipped"),
            "groups_admitted": s.get("groups_admitted"), "groups_no_signal": s.get("groups_no_signal"),
            "base": base, "adapter": adapter, "gain": gain, "worker_cpu_s": round(cpu, 1),
            "gain_per_worker_cpu_hour": gain / (cpu / 3600) if gain is not None and cpu > 0 else None,
            "reward_first_last": (s.get("reward_first"), s.get("reward_last")), "seconds": s.get("seconds"),
            "validator": s.get("validator")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    by_rule: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(args.out.glob("*-seed-*")):
        if (run / "summary.json").is_file():
            r = row(run)
            print(json.dumps(r))
            by_rule.setdefault(run.name.split("-seed-")[0], []).append(r)

    def col(rule: str, key: str) -> list[float]:
        return [float(r[key]) for r in by_rule.get(rule, []) if r[key] is not None]

    for rule in by_rule:
        print(f"{rule}: zero-variance token share {_spread(col(rule, 'zero_variance_token_share'))}; held-out base "
              f"{_spread(col(rule, 'base'))} -> adapter {_spread(col(rule, 'adapter'))}; worker CPU s "
              f"{_spread(col(rule, 'worker_cpu_s'))}; gain per worker CPU-hour "
              f"{_spread(col(rule, 'gain_per_worker_cpu_hour'))}")
    if by_rule.get("none") and by_rule.get("signal"):
        share = _mean(col("signal", "zero_variance_token_share")) / _mean(col("none", "zero_variance_token_share"))
        per_hour = _mean(col("signal", "gain_per_worker_cpu_hour")) / _mean(col("none", "gain_per_worker_cpu_hour"))
        print(f"signal / none: zero-variance token share x{share:.2f}; accuracy gain per worker CPU-hour x{per_hour:.2f}")


if __name__ == "__main__":
    main()
