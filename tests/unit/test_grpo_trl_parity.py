# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""Parity of `policy_loss` with TRL 1.16's own GRPO loss code: same loss and same gradient to 1e-6.

How TRL is called: the real method ``trl.GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) runs on
an object made with ``GRPOTrainer.__new__`` (no model, dataset or generation), holding a real
``trl.GRPOConfig`` as ``args``, a real CPU ``accelerate.Accelerator``, and exactly the attributes
``_compute_loss`` reads, each set from ``args`` as ``GRPOTrainer.__init__`` sets it (``loss_type``,
``importance_sampling_level``, ``epsilon_low``/``epsilon_high``, ``beta``, ``max_completion_length``, ...).
``_get_per_token_logps_and_entropies`` is replaced on that instance by a function returning our fixed
log-prob leaf tensor, so the gradients of both losses w.r.t. that one tensor can be compared. ``inputs`` is
the dict TRL's ``_generate_and_score_completions`` would have produced (``completion_mask``, ``advantages``,
``old_per_token_logps``, ``num_items_in_batch``, ``ref_per_token_logps``, ``importance_sampling_ratio``).
The trainer is in train mode with one process, one accumulation step and ``steps_per_generation=1``, so
TRL's gradient-accumulation divisors are all 1.

Mapping of semantics (ours -> TRL):
  - our ``old_logprobs_BT`` (the sampler's log-probs) -> TRL ``old_per_token_logps``;
  - ``grpo``/``dapo``/``dr_grpo``/``cispo`` -> the ``loss_type`` of the same name; ``gspo`` -> ``loss_type="grpo"``
    with ``importance_sampling_level="sequence"`` (TRL's documented GSPO setup);
  - ``eps_low``/``effective_eps_high`` -> ``epsilon``/``epsilon_high``, except ``cispo``, where TRL's
    ``epsilon_high`` is the absolute cap of the weight: TRL ``epsilon_high = 1 + effective_eps_high``;
  - ``dr_grpo`` constant -> TRL ``max_completion_length``; ``dapo``/``cispo`` token normaliser -> TRL
    ``num_items_in_batch`` = masked token count of the batch;
  - ``kl_beta`` -> ``beta`` with ``use_bias_correction_kl=False`` (TRL's default, True, also multiplies the k3
    term by the importance ratio; we use the plain k3 of DeepSeekMath);
  - ``tis_cap=C`` -> TRL's vLLM importance-sampling correction (``use_vllm=True`` set on the instance,
    ``vllm_importance_sampling_mode="token_truncate"``, ``vllm_importance_sampling_clip_max=C``) with
    ``old_per_token_logps`` = the current log-probs (what TRL's trainer-side recomputation gives with one
    iteration per batch) and ``importance_sampling_ratio`` computed by the same formula TRL's
    ``_generate_and_score_completions`` uses (copied: it's inline there).
Known, deliberate differences (not exercised here): a completion with no masked token counts in TRL's
``grpo`` and ``dr_grpo`` sequence counts but in none of ours; TRL lets NaN in padding reach the loss.

Advantages: TRL computes them inline in ``_generate_and_score_completions``; the last test replicates those
lines (using TRL's own ``nanstd``) and compares with `group_advantages`, including a NaN (unscorable) reward.
"""

import math
import tempfile
import warnings
from collections import defaultdict

import pytest
import torch

from swarmrl.protocol.grpo import LossConfig, group_advantages, policy_loss

trl = pytest.importorskip("trl")
accelerate = pytest.importorskip("accelerate")
from trl.trainer.utils import nanstd

B, T = 5, 7


def _trl_config(**kwargs) -> "trl.GRPOConfig":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trl.GRPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", use_cpu=True, **kwargs)


def _trl_trainer(args, lp_BT: torch.Tensor, *, use_vllm: bool) -> "trl.GRPOTrainer":
    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    trainer.args = args
    # As GRPOTrainer.__init__ sets them from args:
    trainer.loss_type = args.loss_type
    trainer.importance_sampling_level = args.importance_sampling_level
    trainer.epsilon_low = args.epsilon
    trainer.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    trainer.beta = args.beta
    trainer.max_completion_length = args.max_completion_length
    trainer.top_entropy_quantile = args.top_entropy_quantile
    trainer.off_policy_mask_threshold = args.off_policy_mask_threshold
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.entropy_coef = args.entropy_coef
    trainer.use_adaptive_entropy = args.use_adaptive_entropy
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer.aux_loss_enabled = False  # no MoE router
    trainer.use_vllm = use_vllm  # set here, not in args: GRPOConfig(use_vllm=True) wants vLLM installed
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    # What transformers.Trainer provides during training:
    trainer.accelerator = accelerate.Accelerator(cpu=True)
    trainer.model = torch.nn.Linear(1, 1).train()
    trainer.current_gradient_accumulation_steps = 1
    # The one model call: return our fixed log-probs (with their grad path) and dummy entropies.
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (lp_BT, torch.zeros_like(lp_BT), None)
    return trainer


def _batch(seed: int):
    """Variable lengths (1..T, none empty), off-policy ratios in ~[0.5, 2], finite garbage in padding."""
    g = torch.Generator().manual_seed(seed)
    lengths_B = torch.tensor([1, 3, T, 5, 2])
    mask_BT = (torch.arange(T)[None, :] < lengths_B[:, None]).int()
    lp_BT = -torch.rand(B, T, generator=g) * 3
    old_BT = lp_BT + (torch.rand(B, T, generator=g) - 0.5) * 1.4
    ref_BT = lp_BT + (torch.rand(B, T, generator=g) - 0.5)
    adv_B = torch.randn(B, generator=g)
    return lp_BT, old_BT, ref_BT, adv_B, mask_BT


def _trl_kwargs(cfg: LossConfig, max_new_tokens: int) -> dict:
    if cfg.variant == "gspo":
        kw = {"loss_type": "grpo", "importance_sampling_level": "sequence"}
    else:
        kw = {"loss_type": cfg.variant}
    eps_high = cfg.effective_eps_high + (1.0 if cfg.variant == "cispo" else 0.0)
    constant = cfg.loss_constant if cfg.loss_constant is not None else max_new_tokens
    return kw | {
        "epsilon": cfg.eps_low,
        "epsilon_high": eps_high,
        "beta": cfg.kl_beta,
        "use_bias_correction_kl": False,
        "max_completion_length": constant,
        "vllm_importance_sampling_mode": "token_truncate",
        "vllm_importance_sampling_clip_max": cfg.tis_cap if cfg.tis_cap is not None else 3.0,
    }


def _run_trl(cfg: LossConfig, max_new_tokens: int, lp_BT, old_BT, ref_BT, adv_B, mask_BT):
    leaf_BT = lp_BT.clone().requires_grad_()
    tis = cfg.tis_cap is not None
    trainer = _trl_trainer(_trl_config(**_trl_kwargs(cfg, max_new_tokens)), leaf_BT, use_vllm=tis)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask_BT,
        "advantages": adv_B,
        "old_per_token_logps": lp_BT.clone() if tis else old_BT,
        "num_items_in_batch": mask_BT.sum(),
    }
    if cfg.kl_beta:
        inputs["ref_per_token_logps"] = ref_BT
    if tis:  # the formula of _generate_and_score_completions, token_truncate mode, clip_min None
        diff_BT = (inputs["old_per_token_logps"] - old_BT) * mask_BT
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp(diff_BT), min=None, max=cfg.tis_cap)
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad_BT,) = torch.autograd.grad(loss, leaf_BT)
    return loss.detach(), grad_BT


def _run_ours(cfg: LossConfig, max_new_tokens: int, lp_BT, old_BT, ref_BT, adv_B, mask_BT):
    leaf_BT = lp_BT.clone().requires_grad_()
    loss, _ = policy_loss(
        leaf_BT,
        old_BT,
        adv_B,
        mask_BT,
        cfg,
        max_new_tokens=max_new_tokens,
        ref_logprobs_BT=ref_BT if cfg.kl_beta else None,
    )
    (grad_BT,) = torch.autograd.grad(loss, leaf_BT)
    return loss.detach(), grad_BT


CONFIGS = [
    LossConfig(variant="grpo"),
    LossConfig(variant="grpo", eps_high=0.3),
    LossConfig(variant="dapo"),
    LossConfig(variant="dr_grpo"),
    LossConfig(variant="dr_grpo", loss_constant=11),
    LossConfig(variant="gspo"),
    LossConfig(variant="gspo", eps_low=3e-4, eps_high=4e-4),
    LossConfig(variant="cispo"),
    LossConfig(variant="cispo", eps_high=0.5),
]
EXTRAS = [{}, {"kl_beta": 0.04}, {"tis_cap": 1.5}, {"kl_beta": 0.1, "tis_cap": 1.2}]


@pytest.mark.parametrize("extra", EXTRAS, ids=lambda e: ",".join(e) or "plain")
@pytest.mark.parametrize(
    "base", CONFIGS, ids=lambda c: f"{c.variant}-{c.eps_high}-{c.loss_constant}-{c.eps_low}"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_and_gradient_match_trl(base, extra, seed):
    cfg = base.model_copy(update=extra)
    batch = _batch(seed)
    trl_loss, trl_grad = _run_trl(cfg, 9, *batch)
    our_loss, our_grad = _run_ours(cfg, 9, *batch)
    assert math.isfinite(trl_loss.item())
    torch.testing.assert_close(our_loss, trl_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_grad, trl_grad, rtol=0, atol=1e-6)


def test_the_batches_exercise_clipping():
    """Guard against a vacuous parity: the random batches do clip (both sides; and the CISPO cap of 1.5)."""
    lp_BT, old_BT, _, adv_B, mask_BT = _batch(0)
    _, metrics = policy_loss(lp_BT, old_BT, adv_B, mask_BT, LossConfig(variant="grpo"), max_new_tokens=9)
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0
    narrow_gspo = LossConfig(variant="gspo", eps_low=3e-4, eps_high=4e-4)
    _, metrics = policy_loss(lp_BT, old_BT, adv_B, mask_BT, narrow_gspo, max_new_tokens=9)
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0
    cispo = LossConfig(variant="cispo", eps_high=0.5)
    assert policy_loss(lp_BT, old_BT, adv_B, mask_BT, cispo, max_new_tokens=9)[1]["clip_frac_high"] > 0


@pytest.mark.parametrize("scale", ["none", "std"])
def test_advantages_match_trl_formula(scale):
    rewards_NG = torch.tensor([[1.0, 0.0, 0.5, 1.0], [0.2, float("nan"), 0.9, 0.4], [3.0, 3.0, 3.0, 3.0]])
    # TRL 1.16 grpo_trainer.py, _generate_and_score_completions, sum_then_normalize, scale_rewards "group"/"none"
    mean_N = torch.nanmean(rewards_NG, dim=1, keepdim=True)
    trl_adv_NG = rewards_NG - mean_N
    if scale == "std":
        trl_adv_NG = trl_adv_NG / (nanstd(rewards_NG, dim=1, keepdim=True) + 1e-4)
    trl_adv_NG = torch.nan_to_num(trl_adv_NG, nan=0.0)
    ours_NG = torch.stack([group_advantages(r_G, scale=scale, eps=1e-4).advantages_G for r_G in rewards_NG])
    torch.testing.assert_close(ours_NG, trl_adv_NG, rtol=0, atol=1e-6)
