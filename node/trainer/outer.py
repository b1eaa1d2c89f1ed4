"""A DiLoCo job's outer optimizer in one trainer: the outer state, its Nesterov momentum, the step.

Legend: `_P` lists hold float32 tensors in `Learner.params` order.

With `sync = "diloco"` a trainer takes `inner_steps` (H) AdamW steps of its own between outer
steps, publishing each as its own signed inner version. The H-th step ends in an outer step:
the pseudo-gradient (outer parameters minus the learner's) is averaged with the job's other
trainers (`node.swarm.outer_round`), the outer Nesterov step (`protocol.diloco`) is taken from
the outer parameters, and the learner continues from its result, which every trainer of the
round holds bit for bit. The inner AdamW state stays each trainer's own, as in DiLoCo. With an
int8 outer round, what this trainer's pseudo-gradient lost to quantisation (`error_P`) is added
to its next one (error feedback, `node.swarm.outer_round`); a round that does not agree resets it.

A round that does not agree (no cotrainer came within the timeout, a member started from
another outer state) steps on this trainer's own pseudo-gradient; the cotrainers' version/hash
reconciliation at outer versions repairs a split (`node.swarm.cotrainers`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from swarmrl.protocol import diloco
from swarmrl.protocol.jobspec import JobSpec


class OuterAverager(Protocol):
    """What the outer step needs of an outer round (`node.swarm.outer_round.OuterRounds` is one)."""

    def run(self, version: int, start_hash: bytes, delta_P: list[torch.Tensor], weight: float,
            expected: int) -> Any:
        """Average `delta_P` with the round's members; an `OuterOutcome`."""


class OuterOptimizer:
    """DiLoCo's outer parameters and momentum for one job (see the module docstring).

    params: the learner's parameters at the last outer version (copied).
    """

    def __init__(self, spec: JobSpec, params: Sequence[torch.Tensor]) -> None:
        self.lr, self.momentum, self.inner_steps = spec.outer_learning_rate, spec.outer_momentum, spec.inner_steps
        self.outer_P = [p.detach().float().clone() for p in params]
        self.momentum_P = diloco.zero_momentum(params)
        self.error_P: list[torch.Tensor] | None = None   # error feedback of int8 rounds (own, never averaged)
        self.split_winner = ""   # the last round found a split that this cotrainer wins (we adopt its version)
        self.refused: dict[str, str] = {}   # the last round's members left out: peer -> reason

    def start_hash(self) -> bytes:
        """The hash of the outer state a round starts from (outer parameters, then momentum)."""
        return diloco.tensors_hash(self.outer_P + self.momentum_P)

    def reset(self, params: Sequence[torch.Tensor], momentum_P: list[torch.Tensor] | None = None) -> None:
        """Start the next round from `params` (an adopted outer state) and `momentum_P` (kept when
        None). The carried quantisation error is dropped: it was the loss of a round whose outcome
        this trainer has just replaced."""
        self.outer_P = [p.detach().float().clone() for p in params]
        self.error_P = None
        if momentum_P is not None:
            self.momentum_P = [m.detach().float().clone() for m in momentum_P]

    def state_dict(self) -> dict[str, Any]:
        """The outer state for a checkpoint: outer parameters, momentum buffers and the carried
        quantisation error (None when there is none)."""
        return {"outer": [t.clone() for t in self.outer_P], "momentum": [t.clone() for t in self.momentum_P],
                "error": None if self.error_P is None else [t.clone() for t in self.error_P]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()`.

        Raises:
            ValueError: the tensors do not match this job's parameter shapes.
        """
        outer, momentum = list(state["outer"]), list(state["momentum"])
        for what, got in (("outer", outer), ("momentum", momentum)):
            if [tuple(t.shape) for t in got] != [tuple(t.shape) for t in self.outer_P]:
                raise ValueError(f"checkpointed {what} state does not match this job's LoRA parameters")
        self.outer_P = [t.float().clone() for t in outer]
        self.momentum_P = [t.float().clone() for t in momentum]
        error = state.get("error")
        ok = error is not None and [tuple(t.shape) for t in error] == [tuple(t.shape) for t in self.outer_P]
        self.error_P = [t.float().clone() for t in error] if ok and error is not None else None

    def step(self, inner_P: list[torch.Tensor], version: int, averager: OuterAverager | None,
             expected: int) -> tuple[list[torch.Tensor], dict[str, float]]:
        """The outer step that makes outer `version` from the learner's `inner_P`: average the
        pseudo-gradient (alone without `averager`), take the Nesterov step from the outer
        parameters. Returns (the new parameters, the metrics row's outer figures)."""
        t0 = time.monotonic()
        delta_P = diloco.pseudo_gradient(self.outer_P, inner_P)
        if self.error_P is not None and averager is not None:   # error feedback: what the last round lost
            delta_P = [d + e for d, e in zip(delta_P, self.error_P)]
        self.error_P, self.split_winner, self.refused = None, "", {}
        finite = all(bool(torch.isfinite(d).all()) for d in delta_P)
        mine = delta_P if finite else [torch.zeros_like(d) for d in delta_P]
        metrics = {"outer_step": 1.0, "outer_group_size": 1.0, "outer_bytes_sent": 0.0, "outer_agreed": 0.0}
        avg_P: list[torch.Tensor] | None = mine if finite else None
        if averager is not None:
            got = averager.run(version, self.start_hash(), mine, 1.0 if finite else 0.0, expected)
            metrics.update(outer_group_size=float(got.group_size), outer_bytes_sent=float(got.bytes_sent),
                           outer_agreed=float(got.agreed))
            if got.agreed:
                avg_P = got.delta_P
                self.error_P = getattr(got, "send_error_P", None)
            self.split_winner = str(getattr(got, "split_winner", ""))
            self.refused = dict(getattr(got, "refused", {}))
            metrics["outer_refused"] = float(len(self.refused))
        if avg_P is not None:
            step = diloco.nesterov_step(self.outer_P, avg_P, self.momentum_P, lr=self.lr, momentum=self.momentum)
            self.outer_P, self.momentum_P = step.params_P, step.momentum_P
        metrics["outer_seconds"] = time.monotonic() - t0
        metrics["pseudo_grad_norm"] = math.sqrt(sum(float((d.double() ** 2).sum()) for d in mine))
        return [t.clone() for t in self.outer_P], metrics
