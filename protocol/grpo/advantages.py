# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size, N = groups.
"""Group-relative advantages (GRPO, DeepSeekMath, Shao et al. 2024).

Each prompt gets G completions; a completion's advantage is its reward minus the group's mean reward,
optionally divided by the group's standard deviation (``scale="std"``, DeepSeekMath; Dr. GRPO,
Liu et al. 2025, recommends ``"none"`` because the division adds a per-question difficulty bias).
Every token of a completion shares its completion's advantage.

Missing rewards are NaN (a grader that failed or abstained); they, and any infinite reward, are
invalid: masked out of the mean and the std, and given advantage 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# A group is zero-variance when max - min of its valid rewards is <= eps + ZERO_SPREAD_RTOL * max|reward|:
# an absolute floor (eps) for rewards near zero, a relative one for float noise on large rewards
# (float32 carries ~7 significant digits, so 1e-5 relative is well above its rounding error).
ZERO_SPREAD_RTOL = 1e-5

ADVANTAGE_SCALES = ("none", "std")


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one group of G completions of the same prompt.

    Attributes:
        advantages_G: float32 (G,), 0.0 where the reward is invalid and everywhere when ``zero_variance``.
        valid_G: bool (G,), True where the reward is present and finite.
        zero_variance: True when the group carries no signal: fewer than two valid rewards, or a spread of
            valid rewards within ``eps + ZERO_SPREAD_RTOL * max|reward|`` (zero or float noise).
    """

    advantages_G: torch.Tensor
    valid_G: torch.Tensor
    zero_variance: bool


def group_advantages(rewards_G: torch.Tensor, *, scale: str = "none", eps: float = 1e-6) -> GroupAdvantages:
    """Group-relative advantages of one group.

    Args:
        rewards_G: (G,) real tensor of rewards, NaN where missing.
        scale: ``"none"`` gives ``r - mean``; ``"std"`` gives ``(r - mean) / (std + eps)`` with the sample
            standard deviation (Bessel-corrected, as TRL's ``nanstd``) of the valid rewards.
        eps: absolute tolerance of the zero-spread test and the std denominator's epsilon. > 0.

    Returns:
        `GroupAdvantages`; never NaN or inf. Computed in float64, returned as float32 on the input's device.

    Raises:
        ValueError: if rewards_G is not a 1-D real tensor, scale is unknown, or eps is not positive and finite.
    """
    _check_args(rewards_G, scale, eps)
    rewards_G = rewards_G.detach().to(torch.float64)
    valid_G = torch.isfinite(rewards_G)
    zeros_G = torch.zeros_like(rewards_G, dtype=torch.float32)
    valid_rewards = rewards_G[valid_G]
    if valid_rewards.numel() < 2 or _spread_is_noise(valid_rewards, eps):
        return GroupAdvantages(zeros_G, valid_G, zero_variance=True)
    advantages_G = torch.where(valid_G, rewards_G - valid_rewards.mean(), 0.0)
    if scale == "std":
        advantages_G = advantages_G / (valid_rewards.std(correction=1) + eps)
    return GroupAdvantages(advantages_G.to(torch.float32), valid_G, zero_variance=False)


def batch_advantages(
    rewards_NG: torch.Tensor | Sequence[torch.Tensor | Sequence[float]],
    *,
    scale: str = "none",
    eps: float = 1e-6,
) -> list[GroupAdvantages]:
    """`group_advantages` of each group of a batch.

    Args:
        rewards_NG: an (N, G) tensor, or a sequence of N groups (1-D tensors or float sequences, sizes may
            differ), NaN where a reward is missing.
        scale, eps: as in `group_advantages`.

    Returns:
        One `GroupAdvantages` per group, in order. ``torch.cat([g.advantages_G for g in result])`` gives the
        per-completion advantages_B in group-major order.

    Raises:
        ValueError: as `group_advantages`, or if a tensor input is not 2-D.
    """
    if isinstance(rewards_NG, torch.Tensor) and rewards_NG.ndim != 2:
        raise ValueError(f"rewards_NG must be 2-D (N, G), got shape {tuple(rewards_NG.shape)}")
    groups = [g if isinstance(g, torch.Tensor) else torch.tensor(g, dtype=torch.float64) for g in rewards_NG]
    return [group_advantages(g, scale=scale, eps=eps) for g in groups]


def _spread_is_noise(valid_rewards: torch.Tensor, eps: float) -> bool:
    spread = (valid_rewards.max() - valid_rewards.min()).item()
    return spread <= eps + ZERO_SPREAD_RTOL * valid_rewards.abs().max().item()


def _check_args(rewards_G: torch.Tensor, scale: str, eps: float) -> None:
    if not isinstance(rewards_G, torch.Tensor) or rewards_G.ndim != 1:
        raise ValueError(f"rewards_G must be a 1-D tensor, got {type(rewards_G).__name__}")
    if rewards_G.is_complex() or rewards_G.dtype == torch.bool:
        raise ValueError(f"rewards_G must be real numbers, got {rewards_G.dtype}")
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if not (eps > 0.0 and eps < float("inf")):
        raise ValueError(f"eps must be positive and finite, got {eps}")
