"""benchmarks/vs_trl.py's arithmetic on results: accuracy at wall-clock checkpoints, time to a
target, the swarm / TRL ratio (or its bound) and the mean and spread over seeds. Pure: no
model, no process."""

from __future__ import annotations

import math
import statistics
from typing import Any

TAKEN_SLACK_S = 0.25
"""An adapter taken this soon after a checkpoint counts at it: the swarm's watcher polls the
trainer's checkpoints every 0.2 s, so its copy for checkpoint c is made at c + 0-0.2 s."""


def accuracy_at(curve: list[tuple[float, float]], checkpoint_s: float, slack_s: float = TAKEN_SLACK_S) -> float:
    """Accuracy of the latest adapter taken at or before `checkpoint_s` + `slack_s` (NaN before the first)."""
    taken = [acc for t, acc in curve if t <= checkpoint_s + slack_s]
    return taken[-1] if taken else math.nan


def accuracy_by_checkpoint(curve: list[tuple[float, float]], checkpoints: list[float]) -> dict[str, float]:
    """`accuracy_at` each checkpoint, keyed by the checkpoint as written ("150", "300", ...)."""
    return {f"{c:g}": accuracy_at(curve, c) for c in checkpoints}


def time_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time whose adapter reaches `target` accuracy, or None."""
    return next((t for t, acc in sorted(curve) if acc >= target), None)


def ratio(swarm_s: float | None, trl_s: float | None) -> float | None:
    """swarm / TRL time to target; None when either side never got there."""
    return None if swarm_s is None or trl_s is None or trl_s <= 0 else swarm_s / trl_s


def ratio_bound(swarm: dict[str, Any], trl: dict[str, Any]) -> float | None:
    """swarm / TRL time to target when only the swarm got there: TRL trained `wall_s` without
    reaching it, so its time is longer and the ratio is at most swarm time / TRL wall time."""
    if swarm["time_to_target_s"] is None or trl["time_to_target_s"] is not None or not trl["wall_s"]:
        return None
    return swarm["time_to_target_s"] / trl["wall_s"]


def spread(values: list[float | None]) -> dict[str, float | int | None]:
    """Mean, sample std, min and max over the values present (n of them)."""
    xs = [v for v in values if v is not None and not math.isnan(v)]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def summary(per_seed: dict[int, dict[str, Any]], checkpoints: list[float]) -> dict[str, Any]:
    """Mean and spread over seeds of every figure."""
    seeds = list(per_seed.values())
    out: dict[str, Any] = {"base_accuracy": spread([s["base_accuracy"] for s in seeds]),
                           "time_to_target_ratio": spread([s["time_to_target_ratio"] for s in seeds]),
                           "time_to_target_ratio_at_most": spread([s.get("time_to_target_ratio_at_most")
                                                                   for s in seeds])}
    for side in ("swarm", "trl"):
        keys = ("s_per_step", "tokens_per_s", "steps", "final_accuracy", "time_to_target_s")
        out[side] = {k: spread([s[side][k] for s in seeds]) for k in keys}
        out[side]["accuracy_at"] = {f"{c:g}": spread([s[side]["accuracy_at"][f"{c:g}"] for s in seeds])
                                    for c in checkpoints}
    return out
