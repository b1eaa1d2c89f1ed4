"""Fault drills for trainers, injected from outside the step (`TrainerConfig.fault`).

`nan_gradients` makes a trainer a broken peer: the gradients it hands its cotrainers are NaN,
with the weight of its real tokens, so the others must exclude it from the average. The drill
wraps the step's gradient reducer; the step itself (`Learner.step`) knows no drill and never
applies non-finite gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swarmrl.protocol.grpo.reduce import GradientReducer, Reduced

FAULTS = ("nan_gradients",)


class NaNGradients:
    """A reducer wrapper that hands the inner reducer NaN gradients (weight at least 1)."""

    def __init__(self, inner: GradientReducer) -> None:
        self.inner = inner

    def begin(self) -> None:
        """Begin the inner reducer's round."""
        self.inner.begin()

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """Give the inner reducer NaNs shaped as `grads`, claiming `max(weight, 1)` tokens."""
        return self.inner.reduce([torch.full_like(g, float("nan")) for g in grads], max(weight, 1.0))


def reducer_wrap(fault: str | None) -> Callable[[GradientReducer], GradientReducer] | None:
    """The reducer wrapper of a trainer fault drill (None: no drill).

    Raises:
        ValueError: an unknown fault name.
    """
    if fault is None:
        return None
    if fault not in FAULTS:
        raise ValueError(f"unknown trainer fault {fault!r}; known: {', '.join(FAULTS)}")
    return NaNGradients
