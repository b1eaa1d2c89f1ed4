# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""Every loss variant on hand-computed inputs: values, gradients, clipping, masking, KL, TIS, config."""

import math
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import torch

from swarmrl.protocol.grpo import LOSS_VARIANTS, LossConfig, policy_loss

NAN = float("nan")
ROOT = Path(__file__).resolve().parents[2]


def _two_completions(lp_value: float = -0.7):
    """Lengths 2 and 6 in a (2, 6) batch, advantages +1 and -1, on-policy (ratio 1)."""
    mask_BT = torch.zeros(2, 6, dtype=torch.bool)
    mask_BT[0, :2] = True
    mask_BT[1, :] = True
    lp_BT = torch.full((2, 6), lp_value, requires_grad=True)
    return lp_BT, lp_BT.detach().clone(), torch.tensor([1.0, -1.0]), mask_BT


def _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=8, ref_BT=None, **cfg):
    return policy_loss(
        lp_BT,
        old_BT,
        adv_B,
        mask_BT,
        LossConfig(**cfg),
        max_new_tokens=max_new_tokens,
        ref_logprobs_BT=ref_BT,
    )


def _grad(loss, lp_BT):
    (g,) = torch.autograd.grad(loss, lp_BT)
    return g


def _one_row(log_ratios, adv, lp_value=-1.0):
    """One completion with the given per-token log ratios; returns (lp_BT with grad, old_BT, adv_B, mask_BT)."""
    log_ratio_BT = torch.tensor([log_ratios])
    lp_BT = torch.full_like(log_ratio_BT, lp_value).requires_grad_()
    return (
        lp_BT,
        lp_BT.detach() - log_ratio_BT,
        torch.tensor([adv]),
        torch.ones_like(log_ratio_BT, dtype=torch.bool),
    )


# ---- the pinned values ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "extra", "expected"),
    [
        ("grpo", {}, 0.0),
        ("dapo", {}, 0.5),
        ("dr_grpo", {"loss_constant": 8}, 0.25),
        ("gspo", {}, 0.0),
    ],
)
def test_lengths_2_and_6_on_policy(variant, extra, expected):
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=100, variant=variant, **extra)
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    assert metrics["tokens"] == 8.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["ess"] == pytest.approx(1.0)
    assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0


def test_dr_grpo_constant_defaults_to_max_new_tokens():
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    assert _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=8, variant="dr_grpo")[
        0
    ].item() == pytest.approx(0.25)
    assert _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=16, variant="dr_grpo")[
        0
    ].item() == pytest.approx(0.125)
    explicit = _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=8, variant="dr_grpo", loss_constant=2)[0]
    assert explicit.item() == pytest.approx(4 / 2 / 2)


def test_on_policy_gradients_show_each_normalisation():
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    expected_per_row = {  # d loss / d logprob on each real token, rows of length 2 and 6, A = +1 and -1
        "grpo": (-1 / 2 / 2, 1 / 6 / 2),
        "gspo": (-1 / 2 / 2, 1 / 6 / 2),
        "dapo": (-1 / 8, 1 / 8),
        "cispo": (-1 / 8, 1 / 8),
        "dr_grpo": (-1 / 8 / 2, 1 / 8 / 2),
    }
    for variant, (g0, g1) in expected_per_row.items():
        loss, _ = _loss(lp_BT, old_BT, adv_B, mask_BT, max_new_tokens=8, variant=variant)
        g = _grad(loss, lp_BT)
        torch.testing.assert_close(g[0], torch.tensor([g0, g0, 0, 0, 0, 0]), msg=variant)
        torch.testing.assert_close(g[1], torch.full((6,), g1), msg=variant)


# ---- clipping ------------------------------------------------------------------------------------------


def test_grpo_clips_symmetric_by_default():
    ratios = [0.5, 1.5, 1.1, 1.25]
    lp_BT, old_BT, _, mask_BT = _one_row([math.log(r) for r in ratios], 1.0)
    for adv, per_token, grad, low, high in [
        (1.0, [-0.5, -1.2, -1.1, -1.2], [-0.5, 0.0, -1.1, 0.0], 0.0, 0.5),
        (-1.0, [0.8, 1.5, 1.1, 1.25], [0.0, 1.5, 1.1, 1.25], 0.25, 0.0),
    ]:
        loss, metrics = _loss(lp_BT, old_BT, torch.tensor([adv]), mask_BT, variant="grpo")
        assert loss.item() == pytest.approx(sum(per_token) / 4)
        torch.testing.assert_close(_grad(loss, lp_BT)[0], torch.tensor(grad) / 4)
        assert metrics["clip_frac_low"] == low and metrics["clip_frac_high"] == high
        assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 4)


def test_dapo_clip_higher_lets_1_25_through():
    lp_BT, old_BT, adv_B, mask_BT = _one_row([math.log(0.5), math.log(1.25), math.log(1.5)], 1.0)
    loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="dapo")  # hi = 1.28
    assert loss.item() == pytest.approx(-(0.5 + 1.25 + 1.28) / 3)
    torch.testing.assert_close(_grad(loss, lp_BT)[0], torch.tensor([-0.5, -1.25, 0.0]) / 3)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 3)
    # Lower bound 0.8 for negative advantages
    loss, metrics = _loss(lp_BT, old_BT, -adv_B, mask_BT, variant="dapo")
    assert loss.item() == pytest.approx((0.8 + 1.25 + 1.5) / 3)
    assert metrics["clip_frac_low"] == pytest.approx(1 / 3)


def test_explicit_eps_high_overrides_symmetric_grpo():
    lp_BT, old_BT, adv_B, mask_BT = _one_row([math.log(1.25)], 1.0)
    assert _loss(lp_BT, old_BT, adv_B, mask_BT, variant="grpo")[0].item() == pytest.approx(-1.2)
    assert _loss(lp_BT, old_BT, adv_B, mask_BT, variant="grpo", eps_high=0.3)[0].item() == pytest.approx(
        -1.25
    )


def test_gspo_uses_geometric_mean_sequence_ratio():
    log_ratios = [0.1, -0.3, 0.5]  # mean 0.1
    lp_BT, old_BT, adv_B, mask_BT = _one_row(log_ratios, 2.0)
    # pad a second, shorter row with NaN garbage to check the per-sequence mean and the mask
    lp_BT = torch.cat([lp_BT.detach(), torch.tensor([[-1.0, NAN, NAN]])]).requires_grad_()
    old_BT = torch.cat([old_BT, torch.tensor([[-1.0 - math.log(0.5), NAN, NAN]])])
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv_B = torch.tensor([2.0, -1.0])
    s = math.exp(0.1)
    loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="gspo")  # [0.8, 1.2]
    # row 0: -s*2 (unclipped), row 1: ratio 0.5 < 0.8 with A < 0 -> clipped: -(0.8 * -1) = 0.8
    assert loss.item() == pytest.approx((-2 * s + 0.8) / 2)
    g = _grad(loss, lp_BT)
    torch.testing.assert_close(g, torch.tensor([[-2 * s / 3 / 2] * 3, [0.0, 0.0, 0.0]]))
    assert metrics["clip_frac_low"] == 0.5 and metrics["clip_frac_high"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx((s + 0.5) / 2)
    # The paper's narrow range clips s = e^0.1 too
    loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="gspo", eps_low=3e-4, eps_high=4e-4)
    assert loss.item() == pytest.approx((-2 * 1.0004 + (1 - 3e-4)) / 2)
    assert _grad(loss, lp_BT).abs().max() == 0.0
    assert metrics["clip_frac_high"] == 0.5 and metrics["clip_frac_low"] == 0.5


def test_cispo_gradient_is_stopgrad_clipped_weight_times_advantage():
    ratios = [0.1, 2.0, 8.0]
    lp_BT, old_BT, _, mask_BT = _one_row([math.log(r) for r in ratios], 1.0, lp_value=-0.4)
    for adv in (1.5, -1.5):
        loss, metrics = _loss(lp_BT, old_BT, torch.tensor([adv]), mask_BT, variant="cispo")  # cap 5
        weights = torch.tensor([0.1, 2.0, 5.0])
        assert loss.item() == pytest.approx((-weights * adv * -0.4).sum().item() / 3)
        torch.testing.assert_close(_grad(loss, lp_BT)[0], -weights * adv / 3)
        assert metrics["clip_frac_high"] == pytest.approx(1 / 3) and metrics["clip_frac_low"] == 0.0
    loss, _ = _loss(lp_BT, old_BT, torch.tensor([1.0]), mask_BT, variant="cispo", eps_high=0.5)
    torch.testing.assert_close(_grad(loss, lp_BT)[0], -torch.tensor([0.1, 1.5, 1.5]) / 3)


def test_huge_log_ratio_stays_finite():
    lp_BT, old_BT, adv_B, mask_BT = _one_row([200.0, -200.0], -1.0)
    for variant in LOSS_VARIANTS:
        loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, variant=variant)
        assert torch.isfinite(loss) and torch.isfinite(_grad(loss, lp_BT)).all(), variant
        assert all(math.isfinite(v) for v in metrics.values()), variant


# ---- masking -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_all_masked_row_enters_no_denominator(variant):
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    ratio_BT = torch.tensor([[1.1, 0.7, 1, 1, 1, 1], [1.3, 0.9, 1.0, 1.2, 0.6, 1.0]])
    old_BT = old_BT - ratio_BT.log()
    ref = _loss(lp_BT, old_BT, adv_B, mask_BT, variant=variant, loss_constant=8)[0]
    lp3_BT = torch.cat([lp_BT.detach()[:1], torch.full((1, 6), NAN), lp_BT.detach()[1:]]).requires_grad_()
    old3_BT = torch.cat([old_BT[:1], torch.full((1, 6), NAN), old_BT[1:]])
    mask3_BT = torch.cat([mask_BT[:1], torch.zeros(1, 6, dtype=torch.bool), mask_BT[1:]])
    adv3_B = torch.tensor([1.0, 5.0, -1.0])
    loss, metrics = _loss(lp3_BT, old3_BT, adv3_B, mask3_BT, variant=variant, loss_constant=8)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-7)
    g = _grad(loss, lp3_BT)
    assert torch.isfinite(g).all() and (g[1] == 0).all()
    assert metrics["tokens"] == 8.0


@pytest.mark.parametrize("variant", LOSS_VARIANTS)
def test_everything_masked_gives_zero_with_grad_path(variant):
    lp_BT = torch.full((2, 3), NAN).requires_grad_()
    ref_BT = torch.full((2, 3), NAN)
    loss, metrics = _loss(
        lp_BT,
        ref_BT,
        torch.tensor([1.0, -1.0]),
        torch.zeros(2, 3),
        ref_BT=ref_BT,
        variant=variant,
        kl_beta=0.1,
        tis_cap=2.0,
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (lp_BT.grad == 0).all()
    assert metrics == {
        "clip_frac_low": 0.0,
        "clip_frac_high": 0.0,
        "ratio_mean": 1.0,
        "ess": 1.0,
        "tokens": 0.0,
        "kl": 0.0,
        "tis_clip_frac": 0.0,
    }


def test_float_mask_and_nan_padding_are_ignored():
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    loss_bool = _loss(lp_BT, old_BT, adv_B, mask_BT)[0]
    noisy_lp_BT = torch.where(mask_BT, lp_BT.detach(), NAN).requires_grad_()
    noisy_old_BT = torch.where(mask_BT, old_BT, float("inf"))
    loss_float = _loss(noisy_lp_BT, noisy_old_BT, adv_B, mask_BT.float())[0]
    assert loss_float.item() == pytest.approx(loss_bool.item())
    assert torch.isfinite(_grad(loss_float, noisy_lp_BT)).all()


# ---- KL and TIS ----------------------------------------------------------------------------------------


def test_k3_kl_penalty_value_gradient_and_metric():
    lp_BT = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref_BT = torch.tensor([[-1.5, -1.0]])
    x = torch.tensor([-0.5, 1.0])
    k3 = x.exp() - x - 1
    for variant, norm in [("dapo", 2), ("grpo", 2), ("dr_grpo", 8 * 1)]:
        loss, metrics = _loss(
            lp_BT,
            lp_BT.detach(),
            torch.zeros(1),
            torch.ones(1, 2),
            ref_BT=ref_BT,
            variant=variant,
            kl_beta=0.1,
            loss_constant=8,
        )
        assert loss.item() == pytest.approx(0.1 * k3.sum().item() / norm)
        torch.testing.assert_close(_grad(loss, lp_BT)[0], 0.1 * (1 - x.exp()) / norm)
        assert metrics["kl"] == pytest.approx(k3.mean().item())
    # A reference without kl_beta only reports the metric
    loss, metrics = _loss(lp_BT, lp_BT.detach(), torch.zeros(1), torch.ones(1, 2), ref_BT=ref_BT)
    assert loss.item() == 0.0 and metrics["kl"] == pytest.approx(k3.mean().item())
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        _loss(lp_BT, lp_BT.detach(), torch.zeros(1), torch.ones(1, 2), kl_beta=0.1)


def test_tis_caps_the_detached_behaviour_weight():
    lp_BT, old_BT, adv_B, mask_BT = _one_row([0.5, -0.8, 0.0], 1.0)
    w = torch.tensor([1.2, math.exp(-0.8), 1.0])  # min(exp(lp - old), 1.2)
    loss, metrics = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="dapo", tis_cap=1.2)
    assert loss.item() == pytest.approx(-w.sum().item() / 3)
    torch.testing.assert_close(_grad(loss, lp_BT)[0], -w / 3)
    assert metrics["tis_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["clip_frac_high"] == 0.0  # the proximal ratio is 1: nothing clipped
    assert metrics["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.8) + 1) / 3)
    # Without TIS the token with ratio e^0.5 > 1.28 is clipped: zero gradient there
    loss, _ = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="dapo")
    torch.testing.assert_close(_grad(loss, lp_BT)[0], -torch.tensor([0.0, math.exp(-0.8), 1.0]) / 3)
    # CISPO with TIS: weight min(1, cap) * w
    loss, _ = _loss(lp_BT, old_BT, adv_B, mask_BT, variant="cispo", tis_cap=1.2)
    torch.testing.assert_close(_grad(loss, lp_BT)[0], -w / 3)


def test_ess_metric_of_unequal_ratios():
    lp_BT, old_BT, adv_B, mask_BT = _one_row([math.log(1.0), math.log(2.0), math.log(3.0)], 1.0)
    assert _loss(lp_BT, old_BT, adv_B, mask_BT)[1]["ess"] == pytest.approx(36 / 42)


# ---- inputs, detaching, config -------------------------------------------------------------------------


def test_old_reference_and_advantages_are_detached():
    lp_BT, _, _, mask_BT = _two_completions()
    old_BT = lp_BT.detach().clone().requires_grad_()
    ref_BT = (lp_BT.detach() - 0.1).requires_grad_()
    adv_B = torch.tensor([1.0, -1.0], requires_grad=True)
    loss, _ = _loss(lp_BT, old_BT, adv_B, mask_BT, ref_BT=ref_BT, kl_beta=0.1)
    loss.backward()
    assert old_BT.grad is None and ref_BT.grad is None and adv_B.grad is None
    assert lp_BT.grad is not None


def test_bf16_logprobs_are_upcast():
    lp_BT, old_BT, adv_B, mask_BT = _two_completions(-0.75)  # exact in bf16
    loss, _ = _loss(lp_BT.to(torch.bfloat16), old_BT, adv_B, mask_BT)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(0.5)


def test_bad_inputs_raise():
    lp_BT, old_BT, adv_B, mask_BT = _two_completions()
    bad_calls = [
        {"old_BT": old_BT[:, :5]},
        {"mask_BT": mask_BT[:1]},
        {"adv_B": torch.tensor([1.0])},
        {"adv_B": torch.tensor([NAN, 1.0])},
        {"old_BT": torch.where(mask_BT, NAN, old_BT)},
        {"lp_BT": torch.where(mask_BT, float("-inf"), lp_BT)},
        {"max_new_tokens": 0},
        {"lp_BT": lp_BT[0]},
    ]
    for bad in bad_calls:
        args = {"lp_BT": lp_BT, "old_BT": old_BT, "adv_B": adv_B, "mask_BT": mask_BT} | bad
        with pytest.raises(ValueError):
            _loss(args.pop("lp_BT"), args.pop("old_BT"), args.pop("adv_B"), args.pop("mask_BT"), **args)


def test_config_defaults_and_effective_eps_high():
    cfg = LossConfig()
    assert cfg.variant == "dapo" and cfg.eps_low == 0.2 and cfg.effective_eps_high == 0.28
    assert LossConfig(variant="grpo").effective_eps_high == 0.2
    assert LossConfig(variant="gspo", eps_low=3e-4).effective_eps_high == 3e-4
    assert LossConfig(variant="dr_grpo").effective_eps_high == 0.2
    assert LossConfig(variant="cispo").effective_eps_high == 4.0
    assert LossConfig(variant="grpo", eps_high=0.28).effective_eps_high == 0.28
    assert LOSS_VARIANTS == ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
    # "unset" survives a JSON round trip
    again = LossConfig.model_validate_json(LossConfig(variant="grpo").model_dump_json())
    assert again.eps_high is None and again.effective_eps_high == 0.2


@pytest.mark.parametrize(
    "bad",
    [
        {"eps_low": -0.1},
        {"eps_low": 1.5},
        {"eps_high": -0.01},
        {"eps_high": float("inf")},
        {"loss_constant": 0},
        {"tis_cap": 0.0},
        {"tis_cap": -1.0},
        {"kl_beta": -0.1},
        {"kl_beta": float("nan")},
        {"variant": "ppo"},
        {"advantage_scale": "batch"},
        {"unknown_field": 1},
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(pydantic.ValidationError):
        LossConfig(**bad)


def test_config_is_frozen():
    cfg = LossConfig()
    with pytest.raises(pydantic.ValidationError):
        cfg.eps_low = 0.3


def test_package_imports_only_torch_pydantic_and_stdlib():
    code = (
        "import sys, swarmrl.protocol.grpo; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'peft', 'trl', 'hivemind', 'grpc'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
