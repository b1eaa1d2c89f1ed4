# Legend: B = sequences (completions), T = completion tokens (right-padded), G = group size.
"""Length handling of every loss variant at reasoning lengths (37 to 1024 tokens), hand-computed.

Three completions of 1024, 37 and 256 tokens in a (B, 1024) batch, advantages +0.5, -1, +2, and
per-row log importance ratios 0.1, -0.3 and 0 (so row 1's ratio 0.741 is clipped at 0.8 with A < 0).
The expected numbers are written out from the formulas in protocol/grpo/losses.py's docstring:
  grpo/gspo: mean over completions of (sum_t l_t / M_b); dapo/cispo: sum l_t / sum M_b;
  dr_grpo: sum l_t / (K * completions), K = max_new_tokens = 1024.
A truncated completion (finish "length") masked by `loss.mask_truncated` changes none of them:
it enters no denominator (its tokens, its completion, its sequence mean).
"""

import math

import pytest
import torch

from swarmrl.node.trainer.learner import build_step_batch
from swarmrl.protocol.grpo import LossConfig, policy_loss
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

LENGTHS = (1024, 37, 256)
ADV = (0.5, -1.0, 2.0)
LOG_RATIO = (0.1, -0.3, 0.0)
LP = -0.5                      # every token's current log-prob
K = 1024                       # max_new_tokens: the dr_grpo constant


def _batch(extra_truncated: bool = False):
    rows = len(LENGTHS) + extra_truncated
    mask_BT = torch.zeros(rows, K, dtype=torch.bool)
    old_BT = torch.full((rows, K), float("nan"))          # padding holds garbage: must be ignored
    for b, (n, lr) in enumerate(zip(LENGTHS, LOG_RATIO)):
        mask_BT[b, :n] = True
        old_BT[b, :n] = LP - lr
    adv = list(ADV)
    if extra_truncated:   # a 1024-token fragment, masked out (as build_step_batch does with mask_truncated)
        old_BT[-1] = LP - 2.0
        adv.append(5.0)
    lp_BT = torch.full((rows, K), LP, requires_grad=True)
    return lp_BT, old_BT, torch.tensor(adv), mask_BT


def _per_token(r: float, a: float, low: float, high: float) -> float:
    return -min(r * a, min(max(r, low), high) * a)


def _expected(variant: str) -> float:
    ratios = [math.exp(x) for x in LOG_RATIO]
    if variant == "cispo":   # -sg(min(r, 1 + 4)) * A * logprob
        per_token = [-min(r, 5.0) * a * LP for r, a in zip(ratios, ADV)]
    else:
        high = 1.28 if variant == "dapo" else 1.2
        per_token = [_per_token(r, a, 0.8, high) for r, a in zip(ratios, ADV)]
    sums = [n * lt for n, lt in zip(LENGTHS, per_token)]
    if variant in ("grpo", "gspo"):
        return sum(s / n for s, n in zip(sums, LENGTHS)) / 3
    if variant == "dr_grpo":
        return sum(sums) / (K * 3)
    return sum(sums) / sum(LENGTHS)


HAND = {   # the same numbers, worked by hand to 5 digits (r = e^0.1 = 1.10517, e^-0.3 = 0.74082)
    "grpo": (-0.552585 + 0.8 - 2.0) / 3,
    "gspo": (-0.552585 + 0.8 - 2.0) / 3,
    "dapo": (1024 * -0.552585 + 37 * 0.8 + 256 * -2.0) / 1317,
    "dr_grpo": (1024 * -0.552585 + 37 * 0.8 + 256 * -2.0) / (1024 * 3),
    "cispo": (1024 * 0.276293 + 37 * -0.370409 + 256 * 1.0) / 1317,
}


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_long_completions_normalise_as_documented(variant):
    lp_BT, old_BT, adv_B, mask_BT = _batch()
    loss, metrics = policy_loss(lp_BT, old_BT, adv_B, mask_BT, LossConfig(variant=variant), max_new_tokens=K)
    assert loss.item() == pytest.approx(_expected(variant), rel=1e-5)
    assert loss.item() == pytest.approx(HAND[variant], rel=1e-4)
    assert metrics["tokens"] == sum(LENGTHS)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_a_masked_truncated_completion_enters_no_denominator(variant):
    lp_BT, old_BT, adv_B, mask_BT = _batch(extra_truncated=True)
    loss, metrics = policy_loss(lp_BT, old_BT, adv_B, mask_BT, LossConfig(variant=variant), max_new_tokens=K)
    assert loss.item() == pytest.approx(_expected(variant), rel=1e-5)
    assert metrics["tokens"] == sum(LENGTHS)
    (grad,) = torch.autograd.grad(loss, lp_BT)
    assert torch.count_nonzero(grad[-1]) == 0


def test_per_token_gradient_scale_at_1024_tokens():
    """On-policy, A = +1 on a 1024-token and a 37-token completion: a token's gradient is -1/(2 M_b)
    for grpo (long completions' tokens weigh less), -1/1061 for dapo, -1/(2 K) for dr_grpo."""
    mask_BT = torch.zeros(2, K, dtype=torch.bool)
    mask_BT[0, :] = True
    mask_BT[1, :37] = True
    lp_BT = torch.full((2, K), LP, requires_grad=True)
    adv_B = torch.tensor([1.0, 1.0])
    expected = {"grpo": (-1 / 2048, -1 / 74), "dapo": (-1 / 1061, -1 / 1061), "dr_grpo": (-1 / 2048, -1 / 2048)}
    for variant, (g0, g1) in expected.items():
        loss, _ = policy_loss(lp_BT, lp_BT.detach(), adv_B, mask_BT, LossConfig(variant=variant), max_new_tokens=K)
        (grad,) = torch.autograd.grad(loss, lp_BT)
        assert grad[0, 0].item() == pytest.approx(g0, rel=1e-5), variant
        assert grad[1, 0].item() == pytest.approx(g1, rel=1e-5), variant
        assert grad[1, 37:].abs().sum().item() == 0.0


def _spec(**loss):
    return JobSpec(base_model="tiny", base_model_sha256="0" * 64, group_size=2,
                   sampling={"max_new_tokens": K, "stop": ["</answer>"]}, loss=loss)


def _group(lengths_and_finish, rewards):
    comps = [pb.Completion(token_ids=[5] * n, logprobs=[-0.5] * n, finish_reason=f, reward=r, policy_version=0)
             for (n, f), r in zip(lengths_and_finish, rewards)]
    return pb.Group(prompt_index=0, prompt_token_ids=[1, 2], completions=comps)


def test_build_step_batch_masks_truncated_completions_only_when_asked():
    group = _group([(1024, "length"), (300, "stop")], [0.0, 1.1])
    masked = build_step_batch([group], _spec(mask_truncated=True), current_version=0)
    assert masked.mask_BT.shape == (2, 1024)
    assert masked.mask_BT[0].sum() == 0 and masked.mask_BT[1].sum() == 300
    # the truncated completion's reward still sets the group's baseline (advantages -0.55, +0.55)
    torch.testing.assert_close(masked.advantages_B, torch.tensor([-0.55, 0.55]))
    kept = build_step_batch([group], _spec(mask_truncated=False), current_version=0)
    assert kept.mask_BT[0].sum() == 1024


def test_dr_grpo_constant_must_cover_long_completions():
    with pytest.raises(ValueError, match="loss_constant"):
        _spec(variant="dr_grpo", loss_constant=256)
    assert _spec(variant="dr_grpo", loss_constant=1024).loss.loss_constant == 1024


# ---- micro-batches: the same loss and gradients however a long batch is split -------------------


def test_normalizer_makes_micro_batch_losses_sum_to_the_batch_loss():
    from swarmrl.protocol.grpo import LossNormalizer

    lp_BT, old_BT, adv_B, mask_BT = _batch()
    for variant in ("grpo", "dapo", "dr_grpo", "gspo", "cispo"):
        cfg = LossConfig(variant=variant)
        norm = LossNormalizer.of(mask_BT)
        assert (norm.tokens, norm.completions) == (1317.0, 3.0)
        whole, _ = policy_loss(lp_BT, old_BT, adv_B, mask_BT, cfg, max_new_tokens=K)
        parts = [policy_loss(lp_BT[i:i + 1], old_BT[i:i + 1], adv_B[i:i + 1], mask_BT[i:i + 1], cfg,
                             max_new_tokens=K, normalizer=norm)[0] for i in range(3)]
        assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-6), variant


def _groups(rng, prompt_lengths, vocab, length):
    groups = []
    for i, n in enumerate(prompt_lengths):
        comps = [pb.Completion(token_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(1, length))],
                               logprobs=[-1.5] * length, finish_reason="stop", policy_version=0,
                               reward=float(k % 3), rewards=[float(k % 3)]) for k in range(4)]
        for c in comps:
            del c.logprobs[len(c.token_ids):]
        groups.append(pb.Group(prompt_index=i, prompt_token_ids=[2] + [rng.randrange(3, vocab) for _ in range(n)],
                               completions=comps))
    return groups


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_micro_batched_gradients_equal_one_pass(variant, model_cache):
    import random

    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.learner import MICRO_BATCH_TOKENS, Learner, micro_batches

    spec = builtin_job("tiny", model_cache, group_size=4, loss={"variant": variant},
                       sampling={"max_new_tokens": 40, "stop": []})
    path = prepare_base_model("tiny", model_cache)
    one, split = Learner(path, spec), Learner(path, spec, micro_batch_tokens=60)
    groups = _groups(random.Random(0), [5, 9, 3], 300, 40)
    batch = build_step_batch(groups, spec, current_version=0)
    spans = micro_batches(batch, 60)
    assert len(spans) == 3 and spans[0][0] == 0 and spans[-1][1] == 12   # whole groups, in order
    loss_a, metrics_a = one.compute_gradients(batch)
    loss_b, metrics_b = split.compute_gradients(batch)
    assert loss_b == pytest.approx(loss_a, rel=1e-5, abs=1e-7)
    assert metrics_b["micro_batches"] == 3 and metrics_b["tokens"] == metrics_a["tokens"]
    assert one.micro_batch_tokens == MICRO_BATCH_TOKENS // 2   # the default budget, halved for float32 weights
    for ga, gb in zip(one.grads(), split.grads(), strict=True):
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-7)
