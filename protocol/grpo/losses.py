# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""The GRPO-family policy loss: a clipped importance-ratio surrogate and its normalisations.

Sources:
  - GRPO: Shao et al. 2024, "DeepSeekMath" (PPO's clipped surrogate with group-relative advantages,
    per-sequence token mean, k3 KL penalty to the reference model).
  - DAPO: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"
    (clip-higher, token mean over the batch).
  - Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (constant
    normaliser, no length bias).
  - GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (sequence-level ratio, the geometric mean
    of the token ratios; TRL's ``importance_sampling_level="sequence"`` with ``loss_type="grpo"``).
  - CISPO: MiniMax 2025, "MiniMax-M1" (clipped stop-gradient IS weight times the log-prob).
  - TIS: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training".
  - k3: Schulman 2020, "Approximating KL Divergence" (blog).
The variants agree with TRL 1.16's ``GRPOTrainer._compute_loss`` (see tests/unit/test_grpo_trl_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmrl.protocol.grpo.config import LossConfig, LossVariant
from swarmrl.protocol.grpo.metrics import effective_sample_size

# Log importance ratios are clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] before exp (e^20 ~ 5e8): keeps a
# wildly stale token finite; its gradient through the ratio is then zero, as if clipped.
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class LossNormalizer:
    """The whole batch's denominators, for a loss computed one micro-batch at a time.

    tokens: masked tokens in the whole batch (dapo, cispo divide by it).
    completions: completions with at least one masked token in the whole batch (grpo, gspo and
        dr_grpo divide by it).
    With these, the micro-batches' losses (and gradients) sum to the whole batch's: each variant's
    per-token or per-sequence terms are linear, only the denominators are global.
    """

    tokens: float
    completions: float

    @classmethod
    def of(cls, mask_BT: torch.Tensor) -> LossNormalizer:
        """The denominators of a whole batch's (B, T) mask."""
        tokens_B = (mask_BT != 0).sum(-1)
        return cls(float(tokens_B.sum()), float((tokens_B > 0).sum()))

    def denominator(self, variant: LossVariant) -> float:
        """What `variant`'s loss divides the batch's summed per-token (or per-sequence) terms by, up
        to a factor every trainer of a job shares: `tokens` for dapo and cispo, `completions` for
        grpo, gspo and dr_grpo (dr_grpo's constant K is the job's).

        This is a batch's weight when trainers average their gradients: each trainer's gradient is
        its numerator over its denominator, so the average weighted by the denominators is the sum
        of the numerators over the sum of the denominators, which is the gradient one trainer would
        take on the union of the batches. Weighting by tokens is right only for the token-mean
        variants: GRPO with 2 completions of 10 tokens (gradient +1.0) and 2 of 100 (-1.0) has
        union gradient 0.0, which token weights would make -0.82.
        Returns 0.0 for an empty batch (it then gives nothing to the average).
        """
        return self.tokens if variant in ("dapo", "cispo") else self.completions


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    *,
    max_new_tokens: int,
    ref_logprobs_BT: torch.Tensor | None = None,
    normalizer: LossNormalizer | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of a batch of B completions, to minimise.

    Per token the ratio is ``r = pi_theta / pi_behaviour = exp(logprobs - old_logprobs)`` (``old`` being the
    worker's sampling log-probs; there is no separate trainer-side pi_old), and with ``A`` the completion's
    advantage and ``[lo, hi] = [1 - eps_low, 1 + cfg.effective_eps_high]``:

      - ``grpo``, ``dapo``, ``dr_grpo``: ``l_t = -min(r_t * A, clip(r_t, lo, hi) * A)``;
      - ``gspo``: ``s = exp(mean_t log r_t)`` over the completion's masked tokens, every token gets
        ``l_t = -min(s * A, clip(s, lo, hi) * A)``;
      - ``cispo``: ``l_t = -sg(min(r_t, hi)) * A * logprobs_t`` (sg = stop-gradient; no lower bound, as
        MiniMax-M1), so the gradient is ``-min(r_t, hi) * A * grad logprobs_t`` on every token.

    Truncated IS (``cfg.tis_cap = C`` set): the batch is treated as sampled by pi_behaviour while the
    proximal policy of the clip is the trainer's current policy, as in Yao et al. 2025 with their
    trainer-side pi_old equal to the parameters of this forward pass (one optimiser step per batch). So
    the ratio above becomes ``exp(logprobs - sg(logprobs))`` (value 1, gradient ``grad logprobs``, never
    clipped) and each token's policy term is multiplied by the detached weight
    ``w_t = min(exp(sg(logprobs_t) - old_logprobs_t), C)``. This equals TRL's vLLM importance-sampling
    correction in ``token_truncate`` mode with ``old_per_token_logps`` equal to the current log-probs.
    Without ``tis_cap`` the clip runs directly on pi_theta / pi_behaviour.

    KL penalty (``ref_logprobs_BT`` given and ``cfg.kl_beta > 0``): ``l_t += kl_beta * k3_t`` with
    ``k3_t = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1`` (not IS-weighted, not TIS-weighted).

    Normalisation of ``l_t`` over masked tokens (M_b = masked tokens of completion b, and only completions
    with M_b > 0 are counted anywhere):
      - ``grpo``, ``gspo``: mean over completions of (sum_t l_t / M_b);
      - ``dapo``, ``cispo``: sum of all l_t / sum of M_b;
      - ``dr_grpo``: sum of all l_t / (K * number of completions), K = ``cfg.loss_constant`` or
        ``max_new_tokens``.
    If no token is masked in, the loss is 0.0 with a gradient path to ``logprobs_BT`` (a zero gradient).
    With ``normalizer`` (a micro-batch of a larger batch) the token and completion counts are the
    whole batch's, so the micro-batches' losses sum to the whole batch's loss (metrics stay the
    micro-batch's own).

    Args:
        logprobs_BT: (B, T) float log-probs of the sampled tokens under the current policy, WITH grad.
            Computed in float32 at least (a bf16 input is upcast).
        old_logprobs_BT: (B, T) the sampler's (behaviour) log-probs of the same tokens; detached here.
        advantages_B: (B,) per-completion advantages (e.g. from `group_advantages`); detached here.
        mask_BT: (B, T) bool or 0/1, nonzero on real completion tokens (the real EOS included). Given, never
            derived from token ids. Values at masked-out positions of the other inputs are ignored (may be
            anything, NaN included).
        cfg: the `LossConfig`.
        max_new_tokens: the job's completion length limit (the dr_grpo constant when cfg.loss_constant is
            None). >= 1.
        ref_logprobs_BT: (B, T) reference (base) model log-probs; required when cfg.kl_beta > 0; detached.
        normalizer: the whole batch's denominators (`LossNormalizer.of` its mask) when this call is
            one micro-batch of it; None: this batch's own.

    Returns:
        ``(loss, metrics)``: a 0-d tensor, and python floats:
          - ``clip_frac_low`` / ``clip_frac_high``: share of masked tokens (gspo: of completions) whose
            surrogate is clipped: ``r < lo and A < 0`` / ``r > hi and A > 0`` (TRL's definition); for
            cispo, low is 0.0 and high is the share with ``r > hi`` whatever the sign of A;
          - ``ratio_mean``: mean pi_theta / pi_behaviour over masked tokens (gspo: of the sequence ratios
            s), 1.0 if empty;
          - ``ess``: `effective_sample_size` of those same ratios;
          - ``tokens``: the number of masked tokens;
          - ``kl``: mean k3 over masked tokens (only when ref_logprobs_BT is given);
          - ``tis_clip_frac``: share of masked tokens whose TIS weight hit the cap (only with tis_cap).

    Raises:
        TypeError: if cfg is not a `LossConfig`.
        ValueError: on mismatched shapes, non-floating log-probs, non-finite values on masked tokens or in
            advantages, ``max_new_tokens < 1``, or ``kl_beta > 0`` without ``ref_logprobs_BT``.
    """
    _check_inputs(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, cfg, max_new_tokens, ref_logprobs_BT)
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)
    keep_BT = mask_BT != 0
    maskf_BT = keep_BT.to(dtype)
    lp_BT = torch.where(keep_BT, logprobs_BT.to(dtype), 0.0)
    behaviour_BT = torch.where(keep_BT, old_logprobs_BT.detach().to(dtype), 0.0)
    adv_B1 = advantages_B.detach().to(dtype).unsqueeze(1)

    proximal_BT = lp_BT.detach() if cfg.tis_cap is not None else behaviour_BT
    ratio_Bx = _ratio(lp_BT - proximal_BT, maskf_BT, sequence_level=cfg.variant == "gspo")
    per_token_BT = _surrogate(ratio_Bx, lp_BT, adv_B1, cfg).expand_as(lp_BT)
    if cfg.tis_cap is not None:
        per_token_BT = per_token_BT * _tis_weight(proximal_BT, behaviour_BT, cfg.tis_cap)
    kl_BT = None
    if ref_logprobs_BT is not None:
        kl_BT = _k3(torch.where(keep_BT, ref_logprobs_BT.detach().to(dtype), 0.0) - lp_BT)
        if cfg.kl_beta > 0.0:
            per_token_BT = per_token_BT + cfg.kl_beta * kl_BT
    loss = _aggregate(per_token_BT, maskf_BT, cfg, max_new_tokens, normalizer)
    metrics = _metrics(lp_BT, behaviour_BT, ratio_Bx, adv_B1, keep_BT, cfg, kl_BT)
    return loss, metrics


def _ratio(log_ratio_BT: torch.Tensor, maskf_BT: torch.Tensor, *, sequence_level: bool) -> torch.Tensor:
    """(B, T) token ratios, or (B, 1) sequence ratios exp(mean of the masked log-ratios) for GSPO."""
    if sequence_level:
        log_ratio_B = (log_ratio_BT * maskf_BT).sum(-1) / maskf_BT.sum(-1).clamp(min=1.0)
        return torch.exp(log_ratio_B.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)).unsqueeze(1)
    return torch.exp(log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _surrogate(
    ratio_Bx: torch.Tensor, lp_BT: torch.Tensor, adv_B1: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """Per-token (or per-sequence, (B, 1)) policy loss before normalisation."""
    high = 1.0 + cfg.effective_eps_high
    if cfg.variant == "cispo":
        return -ratio_Bx.clamp(max=high).detach() * adv_B1 * lp_BT
    clipped_Bx = ratio_Bx.clamp(1.0 - cfg.eps_low, high)
    return -torch.minimum(ratio_Bx * adv_B1, clipped_Bx * adv_B1)


def _tis_weight(proximal_BT: torch.Tensor, behaviour_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """Detached truncated-IS weight min(pi_proximal / pi_behaviour, cap) per token (1 on padding)."""
    return torch.exp((proximal_BT - behaviour_BT).detach()).clamp(max=cap)


def _k3(log_ref_over_policy_BT: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token: exp(x) - x - 1 with x = log pi_ref - log pi_theta."""
    return torch.expm1(log_ref_over_policy_BT) - log_ref_over_policy_BT


def _aggregate(
    per_token_BT: torch.Tensor, maskf_BT: torch.Tensor, cfg: LossConfig, max_new_tokens: int,
    normalizer: LossNormalizer | None = None,
) -> torch.Tensor:
    """Normalise the masked per-token losses as the variant prescribes; empty completions count nowhere.
    The denominators are the batch's own, or `normalizer`'s (the whole batch of a micro-batch)."""
    tokens_B = maskf_BT.sum(-1)
    if normalizer is None:
        completions: torch.Tensor | float = (tokens_B > 0).sum().clamp(min=1)
        tokens: torch.Tensor | float = tokens_B.sum().clamp(min=1.0)
    else:
        completions, tokens = max(normalizer.completions, 1.0), max(normalizer.tokens, 1.0)
    masked_BT = per_token_BT * maskf_BT
    if cfg.variant in ("grpo", "gspo"):
        return (masked_BT.sum(-1) / tokens_B.clamp(min=1.0)).sum() / completions
    if cfg.variant == "dr_grpo":
        constant = cfg.loss_constant if cfg.loss_constant is not None else max_new_tokens
        return masked_BT.sum() / (constant * completions)
    return masked_BT.sum() / tokens


@torch.no_grad()
def _metrics(
    lp_BT: torch.Tensor,
    behaviour_BT: torch.Tensor,
    ratio_Bx: torch.Tensor,
    adv_B1: torch.Tensor,
    keep_BT: torch.Tensor,
    cfg: LossConfig,
    kl_BT: torch.Tensor | None,
) -> dict[str, float]:
    """Clip fractions, ratio mean, ESS, token count, and optionally KL and the TIS cap fraction."""
    log_ratio_BT = lp_BT - behaviour_BT  # pi_theta / pi_behaviour, whatever the clip's proximal policy
    if cfg.variant == "gspo":
        has_B = keep_BT.any(-1)
        log_w = (log_ratio_BT.sum(-1) / keep_BT.sum(-1).clamp(min=1))[has_B]
        clip_low, clip_high = _clip_fractions(ratio_Bx[has_B, 0], adv_B1[has_B, 0], cfg)
    else:
        log_w = log_ratio_BT[keep_BT]
        adv_BT = adv_B1.expand_as(lp_BT)
        clip_low, clip_high = _clip_fractions(ratio_Bx[keep_BT], adv_BT[keep_BT], cfg)
    log_w = log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    metrics = {
        "clip_frac_low": clip_low,
        "clip_frac_high": clip_high,
        "ratio_mean": torch.exp(log_w).mean().item() if log_w.numel() else 1.0,
        "ess": effective_sample_size(log_w),
        "tokens": float(keep_BT.sum().item()),
    }
    if kl_BT is not None:
        metrics["kl"] = _masked_mean(kl_BT, keep_BT)
    if cfg.tis_cap is not None:
        metrics["tis_clip_frac"] = _masked_mean((torch.exp(log_ratio_BT) > cfg.tis_cap).float(), keep_BT)
    return metrics


def _clip_fractions(ratio_N: torch.Tensor, adv_N: torch.Tensor, cfg: LossConfig) -> tuple[float, float]:
    if ratio_N.numel() == 0:
        return 0.0, 0.0
    high = 1.0 + cfg.effective_eps_high
    if cfg.variant == "cispo":
        return 0.0, (ratio_N > high).float().mean().item()
    low_N = (ratio_N < 1.0 - cfg.eps_low) & (adv_N < 0)
    high_N = (ratio_N > high) & (adv_N > 0)
    return low_N.float().mean().item(), high_N.float().mean().item()


def _masked_mean(x_BT: torch.Tensor, keep_BT: torch.Tensor) -> float:
    return x_BT[keep_BT].mean().item() if keep_BT.any() else 0.0


def _check_inputs(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    max_new_tokens: int,
    ref_logprobs_BT: torch.Tensor | None,
) -> None:
    if not isinstance(cfg, LossConfig):
        raise TypeError(f"cfg must be a LossConfig, got {type(cfg).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if logprobs_BT.ndim != 2:
        raise ValueError(f"logprobs_BT must be 2-D (B, T), got shape {tuple(logprobs_BT.shape)}")
    named = {"old_logprobs_BT": old_logprobs_BT, "mask_BT": mask_BT, "ref_logprobs_BT": ref_logprobs_BT}
    for name, x in named.items():
        if x is not None and x.shape != logprobs_BT.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {tuple(logprobs_BT.shape)}")
    if advantages_B.shape != logprobs_BT.shape[:1]:
        raise ValueError(
            f"advantages_B has shape {tuple(advantages_B.shape)}, expected ({logprobs_BT.shape[0]},)"
        )
    if cfg.kl_beta > 0.0 and ref_logprobs_BT is None:
        raise ValueError("cfg.kl_beta > 0 needs ref_logprobs_BT")
    keep_BT = mask_BT != 0
    for name, x in {"logprobs_BT": logprobs_BT, **named}.items():
        if x is None or name == "mask_BT":
            continue
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if not torch.isfinite(x.detach()[keep_BT]).all():
            raise ValueError(f"{name} holds a non-finite value on a masked-in token")
    if not torch.isfinite(advantages_B.detach()).all():
        raise ValueError("advantages_B holds a non-finite value")
