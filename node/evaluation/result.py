"""One arm's held-out score, shared by single-turn (`heldout.py`) and episode (`episodes.py`) evaluation."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EvalResult:
    """Accuracy (share of completions whose correctness reward is 1) and mean total reward."""

    accuracy: float
    reward_mean: float
    n: int
