# Legend: B = sequences (completions), T = completion tokens, G = group size, N = groups, V = vocabulary.
"""Every loss variant learns a tiny task: a tabular autoregressive policy raises its mean reward.

Task: completions of up to T=4 tokens over a vocabulary of V=8; token 0 is EOS (it ends the completion and
stays in the loss mask); the reward is the number of token 3 in the completion divided by 4. The policy is a
logit table indexed by (position, previous token). Sampling is on-policy from the current table; each batch
is used for two optimiser steps, so the second runs off-policy and exercises the clip. The figure checked is
the exact expected reward of the policy (computed by dynamic programming over the previous token), not a
sample estimate.
"""

import math

import pytest
import torch

from swarmrl.protocol.grpo import LossConfig, batch_advantages, policy_loss

V, T, EOS, TARGET = 8, 4, 0, 3
BOS = V  # the "previous token" index of the first position
GROUPS, G, STEPS, INNER_STEPS = 4, 8, 30, 2


def _logprob_tables(table_TPV: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(table_TPV, dim=-1)


def _sample(table_TPV: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_BT, mask_BT) of n completions; positions after an EOS are padding (mask 0)."""
    probs_TPV = torch.softmax(table_TPV.detach(), dim=-1)
    prev_B = torch.full((n,), BOS)
    alive_B = torch.ones(n, dtype=torch.bool)
    tokens, masks = [], []
    for t in range(T):
        tok_B = torch.multinomial(probs_TPV[t, prev_B], 1, generator=gen).squeeze(1)
        tokens.append(tok_B)
        masks.append(alive_B.clone())
        alive_B = alive_B & (tok_B != EOS)
        prev_B = tok_B
    return torch.stack(tokens, 1), torch.stack(masks, 1)


def _token_logprobs(table_TPV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    logp_TPV = _logprob_tables(table_TPV)
    prev_BT = torch.cat([torch.full_like(tokens_BT[:, :1], BOS), tokens_BT[:, :-1]], dim=1)
    return torch.stack([logp_TPV[t, prev_BT[:, t], tokens_BT[:, t]] for t in range(T)], dim=1)


def _rewards(tokens_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return ((tokens_BT == TARGET) & mask_BT).sum(1).float() / T


def _expected_reward(table_TPV: torch.Tensor) -> float:
    """Exact E[reward] under the policy: propagate the alive mass over the previous token."""
    probs_TPV = torch.softmax(table_TPV.detach().double(), dim=-1)
    prev_P = torch.zeros(V + 1, dtype=torch.float64)
    prev_P[BOS] = 1.0
    expected = 0.0
    for t in range(T):
        next_V = prev_P @ probs_TPV[t]
        expected += next_V[TARGET].item()
        prev_P = torch.cat([next_V, torch.zeros(1, dtype=torch.float64)])
        prev_P[EOS] = 0.0  # ended
    return expected / T


def _train(cfg: LossConfig, seed: int = 0) -> tuple[float, float]:
    gen = torch.Generator().manual_seed(seed)
    table_TPV = torch.zeros(T, V + 1, V, requires_grad=True)
    ref_table_TPV = table_TPV.detach().clone()
    opt = torch.optim.Adam([table_TPV], lr=0.05)
    start = _expected_reward(table_TPV)
    for _ in range(STEPS):
        tokens_BT, mask_BT = _sample(table_TPV, GROUPS * G, gen)
        with torch.no_grad():
            sampler_BT = _token_logprobs(table_TPV, tokens_BT)
            ref_BT = _token_logprobs(ref_table_TPV, tokens_BT)
        groups = batch_advantages(_rewards(tokens_BT, mask_BT).view(GROUPS, G), scale=cfg.advantage_scale)
        adv_B = torch.cat([g.advantages_G for g in groups])
        for _ in range(INNER_STEPS):
            loss, metrics = policy_loss(
                _token_logprobs(table_TPV, tokens_BT),
                sampler_BT,
                adv_B,
                mask_BT,
                cfg,
                max_new_tokens=T,
                ref_logprobs_BT=ref_BT,
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert torch.isfinite(loss) and all(math.isfinite(v) for v in metrics.values())
    return start, _expected_reward(table_TPV)


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(variant="grpo", advantage_scale="std"),
        LossConfig(variant="dapo"),
        LossConfig(variant="dr_grpo"),
        LossConfig(variant="gspo", eps_low=3e-4, eps_high=4e-4),
        LossConfig(variant="cispo"),
        LossConfig(variant="dapo", tis_cap=2.0, kl_beta=0.01),
    ],
    ids=lambda c: f"{c.variant}-tis{c.tis_cap}-kl{c.kl_beta}",
)
def test_variant_raises_mean_reward(cfg):
    torch.set_num_threads(1)
    start, end = _train(cfg)
    assert start == pytest.approx(0.125 * (1 + 7 / 8 + (7 / 8) ** 2 + (7 / 8) ** 3) / 4)  # uniform policy
    assert end > start + 0.3, f"{cfg.variant}: expected reward {start:.3f} -> {end:.3f}"
