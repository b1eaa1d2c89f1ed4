"""DiLoCo's outer step: pseudo-gradients and outer Nesterov momentum SGD, as pure functions.

Legend: every argument is a list of float32 tensors in one fixed order (the LoRA parameters,
`Learner.params` order); `_P` marks such a list. H = inner steps between outer steps.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv:2311.08105, Algorithm 1): every trainer starts a round from the same outer
parameters theta, takes H inner optimizer steps on its own data, and the trainers average the
pseudo-gradient Delta = theta - theta_inner (the change since the round began, sign flipped, so
it points like a gradient). The outer optimizer is SGD with Nesterov momentum (the paper's best:
lr 0.7, momentum 0.9), written as torch.optim.SGD(nesterov=True, dampening=0) computes it:

    m' = mu * m + Delta          (m = 0 before the first outer step)
    theta' = theta - lr * (Delta + mu * m')

Every trainer of a round holds the same theta and m and receives the same averaged Delta
(`node.swarm.averaging` makes it bit-identical), and these elementwise float32 operations are
deterministic, so every trainer ends the round with bit-identical theta' and m'.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterStep:
    """The result of one outer step: the new outer parameters and momentum buffers."""

    params_P: list[torch.Tensor]
    momentum_P: list[torch.Tensor]


def _check_same(a_P: Sequence[torch.Tensor], b_P: Sequence[torch.Tensor], what: str) -> None:
    if len(a_P) != len(b_P):
        raise ValueError(f"{what}: {len(a_P)} tensors against {len(b_P)}")
    for i, (a, b) in enumerate(zip(a_P, b_P)):
        if a.shape != b.shape:
            raise ValueError(f"{what}: tensor {i} has shape {tuple(b.shape)}, expected {tuple(a.shape)}")


def pseudo_gradient(outer_P: Sequence[torch.Tensor], inner_P: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Delta = outer - inner, per tensor, in float32 (the change since the last outer step).

    Raises:
        ValueError: the lists differ in length or a tensor in shape.
    """
    _check_same(outer_P, inner_P, "pseudo-gradient")
    return [o.detach().float() - i.detach().float() for o, i in zip(outer_P, inner_P)]


def zero_momentum(template_P: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Momentum buffers before the first outer step: float32 zeros shaped like `template_P`."""
    return [torch.zeros_like(t, dtype=torch.float32) for t in template_P]


def nesterov_step(outer_P: Sequence[torch.Tensor], delta_P: Sequence[torch.Tensor],
                  momentum_P: Sequence[torch.Tensor], *, lr: float, momentum: float) -> OuterStep:
    """One outer Nesterov SGD step (module docstring); the inputs are not modified.

    outer_P: the outer parameters theta the round began from.
    delta_P: the averaged pseudo-gradient.
    momentum_P: the momentum buffers m (`zero_momentum` before the first step).
    lr: outer learning rate (> 0); momentum: mu in [0, 1).

    Raises:
        ValueError: lr <= 0, momentum outside [0, 1), mismatched lists or shapes, or a
            non-finite pseudo-gradient.
    """
    if not lr > 0:
        raise ValueError(f"outer learning rate must be > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"outer momentum must be in [0, 1), got {momentum}")
    _check_same(outer_P, delta_P, "outer step (pseudo-gradient)")
    _check_same(outer_P, momentum_P, "outer step (momentum)")
    if not all(bool(torch.isfinite(d).all()) for d in delta_P):
        raise ValueError("outer step: the pseudo-gradient is not finite")
    # one IEEE operation at a time (no fused `alpha` forms, which vectorised and scalar code may
    # round differently): every element rounds the same whatever the thread count or tensor size
    new_m_P = [m.float().mul(momentum).add(d.float()) for m, d in zip(momentum_P, delta_P)]
    new_P = [p.float().sub(d.float().add(m.mul(momentum)).mul(lr)) for p, d, m in zip(outer_P, delta_P, new_m_P)]
    return OuterStep(new_P, new_m_P)


def is_outer_version(version: int, inner_steps: int) -> bool:
    """Whether `version` is an outer (common) version: every H-th version, 0 included."""
    return version % inner_steps == 0


def last_outer_version(version: int, inner_steps: int) -> int:
    """The outer version a trainer at `version` started its round from."""
    return version - version % inner_steps


def tensors_hash(tensors_P: Sequence[torch.Tensor]) -> bytes:
    """sha256 over the shapes and float32 bytes of `tensors_P`, in order (who holds what)."""
    h = hashlib.sha256(b"swarmrl-tensors\x00")
    for t in tensors_P:
        x = t.detach().float().contiguous()
        h.update(repr(tuple(x.shape)).encode())
        h.update(x.numpy().tobytes())
    return h.digest()
