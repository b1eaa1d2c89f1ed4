# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""Configuration of the GRPO-family policy loss: which variant, its clip range, its normalisation.

Plain data (pydantic, frozen): it travels inside a job spec and builds nothing. The math that reads
it lives in `advantages.py` (advantage scaling) and `losses.py` (everything else); two switches
(`drop_zero_variance_groups`, `mask_truncated`) act on how the trainer assembles a batch and are
only carried here so that one object describes the whole objective.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import pydantic
from pydantic import ConfigDict, Field

LossVariant = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
LOSS_VARIANTS: tuple[str, ...] = get_args(LossVariant)

# Variant defaults of eps_high when the user leaves it unset (None). See LossConfig.effective_eps_high.
DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025, sec. 3.1)
CISPO_EPS_HIGH = 4.0  # IS-weight cap 1 + 4 = 5: ScaleRL's / TRL's recommended CISPO epsilon_max of 5.0

_NonNegFloat = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class LossConfig(pydantic.BaseModel):
    """The policy-loss objective of one job.

    Fields:
        variant: the loss family.
            - ``grpo``: PPO clipped surrogate on the per-token ratio, per-sequence token mean, then mean over
              sequences (DeepSeekMath, Shao et al. 2024).
            - ``dapo`` (default): clip-higher (eps_high > eps_low) and one token mean over the whole batch
              (DAPO, Yu et al. 2025).
            - ``dr_grpo``: token sum divided by a constant, then mean over sequences (Dr. GRPO,
              "Understanding R1-Zero-Like Training", Liu et al. 2025). Pair it with ``advantage_scale="none"``.
            - ``gspo``: one ratio per sequence, the geometric mean of its token ratios, clipped; mean over
              sequences (GSPO, Zheng et al. 2025). The paper's clip range is far narrower than PPO's:
              eps_low=3e-4, eps_high=4e-4. These are NOT applied automatically: set them yourself.
            - ``cispo``: clipped, stop-gradient importance weight times the log-prob, token mean over the batch
              (CISPO, MiniMax-M1, 2025).
        eps_low: lower clip, the ratio is clipped below at ``1 - eps_low`` (unused by ``cispo``, which, as in
            MiniMax-M1, imposes no lower bound on its weight). In [0, 1].
        eps_high: upper clip, the ratio is clipped above at ``1 + eps_high``. ``None`` (default) means the
            variant's default, see `effective_eps_high`: 0.28 for ``dapo`` (clip-higher), ``eps_low``
            (symmetric, PPO) for ``grpo``/``dr_grpo``/``gspo``, 4.0 for ``cispo`` (weight cap 5.0).
            A ``None`` default rather than 0.28 keeps "unset" distinguishable after a JSON round trip.
        loss_constant: the ``dr_grpo`` divisor; ``None`` uses the job's ``max_new_tokens`` given to
            `policy_loss` at call time. Ignored by the other variants. >= 1.
        advantage_scale: ``"none"`` (reward minus group mean; Dr. GRPO) or ``"std"`` (also divided by the
            group's std; DeepSeekMath). Read by the trainer and passed to `group_advantages`.
        drop_zero_variance_groups: DAPO's dynamic filtering. The trainer leaves groups whose advantages are
            all zero (`GroupAdvantages.zero_variance`) out of the batch, so they don't dilute the
            token/sequence denominators. The loss itself never sees groups.
        mask_truncated: the trainer zeroes the loss mask of completions cut by the length limit (finish
            reason "length"), as DAPO's overlong filtering. The loss itself never derives masks.
        tis_cap: truncated importance sampling cap C > 0 (Yao et al. 2025, "Your efficient RL framework
            secretly brings you off-policy RL training"); ``None`` disables it. See `policy_loss` for exactly
            what it does here.
        kl_beta: weight of the k3 KL penalty to the reference (base) model; 0 disables it. >= 0.

    Raises:
        pydantic.ValidationError: on unknown fields, unknown variants, negative or non-finite numbers,
            ``eps_low > 1``, ``loss_constant < 1``, ``tis_cap <= 0``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: LossVariant = "dapo"
    eps_low: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.2
    eps_high: _NonNegFloat | None = None
    loss_constant: Annotated[int, Field(ge=1)] | None = None
    advantage_scale: Literal["none", "std"] = "none"
    drop_zero_variance_groups: bool = True
    mask_truncated: bool = False
    tis_cap: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    kl_beta: _NonNegFloat = 0.0

    @property
    def effective_eps_high(self) -> float:
        """The upper clip epsilon actually used: ``eps_high`` if set, else the variant's default."""
        if self.eps_high is not None:
            return self.eps_high
        if self.variant == "dapo":
            return DAPO_EPS_HIGH
        if self.variant == "cispo":
            return CISPO_EPS_HIGH
        return self.eps_low
