"""The gradient-reduce hook of a GRPO step: between backward and the optimizer, a trainer's LoRA
gradients are combined with those of the job's other trainers.

A lone trainer reduces with the identity (`LocalReduce`); several trainers of one job average
over hivemind (`node.swarm.job_swarm.AveragingReduce`). The step itself
(`node.trainer.learner.Learner.step`) is the same in both cases, as TorchTitan keeps one training
loop and reduces gradients through hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Reduced:
    """What a `GradientReducer` decided for one step.

    grads: the gradients to step on, one per LoRA parameter in `Learner.params` order (shapes as
        the parameters); None: take no optimizer step (nobody had a usable gradient).
    abandon: drop the step entirely: nothing is applied and the caller keeps the groups pending
        (a cotrainer got ahead; the trainer adopts its state instead).
    metrics: extra figures for the step's metrics row (e.g. how many trainers averaged).
    """

    grads: list[torch.Tensor] | None
    abandon: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class GradientReducer(Protocol):
    """The seam between the backward pass and the optimizer step (see the module docstring)."""

    def begin(self) -> None:
        """Called before the forward pass (averaging starts matchmaking here, overlapping it)."""

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """Combine this trainer's gradients with others'.

        grads: this trainer's LoRA gradients (zeros when it has none or they are not finite).
        weight: the loss's denominator behind them (`LossNormalizer.denominator`: tokens or
            completions by variant; 0.0 when there is nothing to give).
        """
        ...


class LocalReduce:
    """A lone trainer: its own gradient, no step when it has none (weight 0)."""

    def begin(self) -> None:
        """Nothing to prepare."""

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """The identity; `Reduced(None)` when `weight` is 0 (no tokens, or non-finite gradients)."""
        return Reduced(grads if weight > 0 else None)
