# Legend: B = sequences (completions), T = completion tokens (right-padded), N = samples.
"""Off-policy health figures of a training batch: effective sample size, log-prob drift, staleness.

In an async pipeline (PipelineRL, prime-rl) rollouts are sampled by older policy versions and by an
inference engine whose numerics differ from the trainer's; these say how far off-policy a batch is.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from collections.abc import Sequence
from typing import SupportsIndex, cast

import torch


def effective_sample_size(log_weights_N: torch.Tensor) -> float:
    """Normalised effective sample size of importance weights, ``(sum w)^2 / (N * sum w^2)``.

    Computed in log space (``exp(2 * logsumexp(lw) - logsumexp(2 * lw) - log N)``) in float64, so huge or
    tiny weights don't overflow. 1.0 when all weights are equal, about 1/N when one weight dominates.

    Args:
        log_weights_N: (N,) log importance weights, e.g. masked ``logprob_trainer - logprob_sampler``.
            ``-inf`` is a zero weight.

    Returns:
        A float in (0, 1]. Conventions: an empty input gives 1.0 (nothing is wasted); all-zero weights
        (every entry ``-inf``) give 0.0 (nothing is usable).

    Raises:
        ValueError: if the input is not 1-D, or holds NaN or ``+inf``.
    """
    if log_weights_N.ndim != 1:
        raise ValueError(f"log_weights_N must be 1-D, got shape {tuple(log_weights_N.shape)}")
    lw_N = log_weights_N.detach().to(torch.float64)
    if torch.isnan(lw_N).any() or torch.isposinf(lw_N).any():
        raise ValueError("log_weights_N holds NaN or +inf")
    n = lw_N.numel()
    if n == 0:
        return 1.0
    if torch.isneginf(lw_N).all():
        return 0.0
    log_ess = 2.0 * torch.logsumexp(lw_N, 0) - torch.logsumexp(2.0 * lw_N, 0) - math.log(n)
    return min(1.0, math.exp(log_ess.item()))


def logprob_drift(
    trainer_logprobs_BT: torch.Tensor, sampler_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's log-probs of the sampled tokens are from the sampler's.

    With ``d = trainer - sampler`` per masked token:
      - ``drift_abs_mean``: mean ``|d|`` (nats);
      - ``drift_k3_kl``: mean ``exp(d) - 1 - d``, the k3 estimator of KL(sampler || trainer) from tokens
        sampled by the sampler (Schulman, "Approximating KL divergence", 2020); >= 0.
    Both are 0.0 when no token is masked in.

    Args:
        trainer_logprobs_BT, sampler_logprobs_BT: (B, T) log-probs of the same sampled tokens.
        mask_BT: (B, T) bool or 0/1, nonzero on real completion tokens.

    Raises:
        ValueError: on mismatched shapes or a non-finite log-prob on a masked token.
    """
    if not trainer_logprobs_BT.shape == sampler_logprobs_BT.shape == mask_BT.shape:
        raise ValueError(
            f"shapes differ: trainer {tuple(trainer_logprobs_BT.shape)}, "
            f"sampler {tuple(sampler_logprobs_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    keep = mask_BT != 0
    d = (
        trainer_logprobs_BT.detach().to(torch.float64)[keep]
        - sampler_logprobs_BT.detach().to(torch.float64)[keep]
    )
    if not torch.isfinite(d).all():
        raise ValueError("non-finite log-prob on a masked token")
    if d.numel() == 0:
        return {"drift_abs_mean": 0.0, "drift_k3_kl": 0.0}
    return {"drift_abs_mean": d.abs().mean().item(), "drift_k3_kl": torch.expm1(d).sub(d).mean().item()}


def staleness_histogram(staleness_N: Sequence[int]) -> dict[int, int]:
    """Count of rollouts per staleness (trainer version at the step minus the rollout's policy version).

    Args:
        staleness_N: one non-negative int (or numpy/torch integer scalar) per rollout or group.

    Returns:
        ``{staleness: count}`` with keys ascending; empty for an empty input.

    Raises:
        ValueError: on a negative value or a non-int (bools are rejected too).
    """
    values = [_non_negative_int(s) for s in staleness_N]
    return dict(sorted(Counter(values).items()))


def _non_negative_int(s: object) -> int:
    try:
        # int, numpy integer, 0-d integer tensor; not float (TypeError for anything else)
        value = operator.index(cast(SupportsIndex, s))
    except TypeError:
        value = -1
    if isinstance(s, bool) or value < 0:
        raise ValueError(f"staleness must be a non-negative int, got {s!r}")
    return value
