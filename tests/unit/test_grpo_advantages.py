# Legend: G = group size, N = groups or samples, B = sequences, T = completion tokens.
"""Group-relative advantages and the off-policy metrics, on hand-computed values."""

import math

import numpy as np
import pytest
import torch

from swarmrl.protocol.grpo import (
    GroupAdvantages,
    batch_advantages,
    effective_sample_size,
    group_advantages,
    logprob_drift,
    staleness_histogram,
)

NAN = float("nan")


def test_equal_rewards_give_zero_and_zero_variance():
    out = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert out.zero_variance
    assert out.advantages_G.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out.valid_G.all()
    assert out.advantages_G.dtype == torch.float32


def test_nan_reward_is_masked_out_of_mean():
    out = group_advantages(torch.tensor([1.0, NAN, 0.0, 1.0]))
    assert not out.zero_variance
    assert out.valid_G.tolist() == [True, False, True, True]
    torch.testing.assert_close(out.advantages_G, torch.tensor([1 / 3, 0.0, -2 / 3, 1 / 3]))


def test_std_scale_uses_bessel_std_of_valid_rewards():
    out = group_advantages(torch.tensor([1.0, NAN, 0.0, 1.0]), scale="std", eps=1e-6)
    std = math.sqrt(((1 / 3) ** 2 * 2 + (2 / 3) ** 2) / 2)  # n - 1 = 2
    expected = torch.tensor([1 / 3, 0.0, -2 / 3, 1 / 3]) / (std + 1e-6)
    torch.testing.assert_close(out.advantages_G, expected)


@pytest.mark.parametrize(
    "rewards",
    [[NAN, NAN, NAN], [NAN, 0.5, NAN], [0.7], [], [float("inf"), 0.0, NAN], [3.0, 3.0 + 1e-9, 3.0 - 1e-9]],
)
@pytest.mark.parametrize("scale", ["none", "std"])
def test_degenerate_groups_give_exact_zeros(rewards, scale):
    out = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale=scale)
    assert out.zero_variance
    assert out.advantages_G.shape == (len(rewards),)
    assert (out.advantages_G == 0.0).all()


def test_float_noise_on_large_rewards_is_zero_variance():
    r = torch.tensor([1e4, 1e4, 1e4], dtype=torch.float64)
    r[1] += 1e-3  # relative 1e-7: noise
    out = group_advantages(r, scale="std")
    assert out.zero_variance and (out.advantages_G == 0).all()
    r[1] += 1.0  # relative 1e-4: signal
    assert not group_advantages(r).zero_variance


def test_infinite_reward_is_invalid():
    out = group_advantages(torch.tensor([float("inf"), 1.0, 0.0]))
    assert out.valid_G.tolist() == [False, True, True]
    torch.testing.assert_close(out.advantages_G, torch.tensor([0.0, 0.5, -0.5]))


def test_std_scaled_advantages_stay_bounded_for_tiny_spread():
    out = group_advantages(torch.tensor([0.0, 0.0, 0.0, 2e-6], dtype=torch.float64), scale="std")
    assert not out.zero_variance
    assert out.advantages_G.abs().max() <= 2.0  # |r - mean| / std <= (G - 1) / sqrt(G)


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), scale="batch")
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(3), eps=0.0)
    with pytest.raises(ValueError):
        batch_advantages(torch.zeros(3))


def test_batch_advantages_handles_ragged_groups():
    out = batch_advantages([[1.0, 0.0], torch.tensor([2.0, 2.0, 2.0]), [NAN, 1.0, 3.0]])
    assert all(isinstance(g, GroupAdvantages) for g in out)
    assert [g.zero_variance for g in out] == [False, True, False]
    flat_B = torch.cat([g.advantages_G for g in out])
    torch.testing.assert_close(flat_B, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0]))
    tensor_out = batch_advantages(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert [g.zero_variance for g in tensor_out] == [False, True]


def test_ess_equal_weights_is_one():
    assert effective_sample_size(torch.full((7,), -3.0)) == pytest.approx(1.0)
    assert effective_sample_size(torch.full((5,), 300.0)) == pytest.approx(1.0)  # no overflow


def test_ess_one_dominant_weight_is_about_one_over_n():
    n = 10
    lw_N = torch.zeros(n)
    lw_N[0] = 50.0
    assert effective_sample_size(lw_N) == pytest.approx(1 / n, rel=1e-6)


def test_ess_hand_computed_and_conventions():
    w = torch.tensor([1.0, 2.0, 3.0])
    assert effective_sample_size(w.log()) == pytest.approx(36 / (3 * 14))
    assert effective_sample_size(torch.tensor([])) == 1.0
    assert effective_sample_size(torch.tensor([float("-inf"), float("-inf")])) == 0.0
    assert effective_sample_size(torch.tensor([float("-inf"), 0.0])) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        effective_sample_size(torch.tensor([NAN]))


def test_logprob_drift_over_masked_tokens():
    trainer_BT = torch.tensor([[-1.0, -2.0, 99.0], [-0.5, NAN, NAN]])
    sampler_BT = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = logprob_drift(trainer_BT, sampler_BT, mask_BT)
    d = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    assert out["drift_abs_mean"] == pytest.approx(0.5)
    assert out["drift_k3_kl"] == pytest.approx((d.exp() - 1 - d).mean().item())
    assert out["drift_k3_kl"] > 0
    empty = logprob_drift(trainer_BT, sampler_BT, torch.zeros(2, 3))
    assert empty == {"drift_abs_mean": 0.0, "drift_k3_kl": 0.0}


def test_staleness_histogram():
    assert staleness_histogram([2, 0, 2, 1, 0, 2]) == {0: 2, 1: 1, 2: 3}
    assert list(staleness_histogram([3, 1, 2])) == [1, 2, 3]
    assert staleness_histogram([]) == {}
    assert staleness_histogram([np.int64(1), torch.tensor(1)]) == {1: 2}
    for bad in ([-1], [1.5], [True]):
        with pytest.raises(ValueError):
            staleness_histogram(bad)
