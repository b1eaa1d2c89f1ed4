# Legend: B = completions, T = completion tokens (right-padded).
"""Trainers average their gradients weighted by each batch's loss denominator
(`LossNormalizer.denominator`), so that for every loss variant two trainers' averaged step is the
step one trainer would take on the union of their batches (issue 26 item 3).

Three levels: the issue's worked GRPO example; `policy_loss` on two batches of different lengths,
off-policy, for every variant (with the KL penalty too); and the real `Learner` (peft LoRA on the
tiny model) whose reducer receives the gradients and the weight it would give the average.
"""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.learner import Learner
from swarmrl.protocol.grpo import LOSS_VARIANTS, LossConfig, policy_loss
from swarmrl.protocol.grpo.losses import LossNormalizer
from swarmrl.protocol.grpo.reduce import Reduced
from swarmrl.protocol.pb import swarm_pb2 as pb

MAX_NEW = 128


def _batch(lengths: list[int], advantages: list[float], seed: int, T: int | None = None):
    """(mask_BT, feature_BT, old_BT, ref_BT, adv_B) for completions of `lengths` tokens."""
    gen = torch.Generator().manual_seed(seed)
    T = T or max(lengths)
    mask_BT = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        mask_BT[b, :n] = True
    feature_BT = torch.randn(len(lengths), T, generator=gen)
    old_BT = -1.0 + 0.3 * torch.randn(len(lengths), T, generator=gen)
    ref_BT = -1.0 + 0.3 * torch.randn(len(lengths), T, generator=gen)
    return mask_BT, feature_BT, old_BT, ref_BT, torch.tensor(advantages)


def _pad(x_BT: torch.Tensor, T: int) -> torch.Tensor:
    return torch.nn.functional.pad(x_BT, (0, T - x_BT.shape[1]))


def _grad(batch, cfg: LossConfig) -> torch.Tensor:
    """d loss / d theta, logprobs = -1 + theta * feature (theta a (2,) parameter: two directions)."""
    mask_BT, feature_BT, old_BT, ref_BT, adv_B = batch
    theta = torch.tensor([0.05, -0.02], requires_grad=True)
    lp_BT = -1.0 + theta[0] * feature_BT + theta[1] * feature_BT.square()
    loss, _ = policy_loss(lp_BT, old_BT, adv_B, mask_BT, cfg, max_new_tokens=MAX_NEW,
                          ref_logprobs_BT=ref_BT if cfg.kl_beta > 0 else None)
    (g,) = torch.autograd.grad(loss, theta)
    return g


def _union(a, b):
    T = max(a[0].shape[1], b[0].shape[1])
    return tuple(torch.cat([_pad(x, T), _pad(y, T)]) if x.dim() == 2 else torch.cat([x, y])
                 for x, y in zip(a, b, strict=True))


def _averaged(cfg: LossConfig, a, b, weight_of) -> torch.Tensor:
    wa, wb = weight_of(a[0]), weight_of(b[0])
    return (wa * _grad(a, cfg) + wb * _grad(b, cfg)) / (wa + wb)


def test_the_issues_grpo_example_averages_to_zero_not_minus_0_82():
    """GRPO, on-policy: trainer A has 2 completions of 10 tokens whose per-sequence gradient is
    +1.0, trainer B 2 of 100 tokens at -1.0. The union's gradient is 0.0; token weights give -0.82."""
    cfg = LossConfig(variant="grpo")

    def grad(n_tokens: int, advantage: float) -> tuple[torch.Tensor, torch.Tensor]:
        mask_BT = torch.ones(2, n_tokens, dtype=torch.bool)
        theta = torch.zeros((), requires_grad=True)
        lp_BT = -1.0 + theta * torch.ones(2, n_tokens)    # d r_t / d theta = 1 on-policy
        loss, _ = policy_loss(lp_BT, lp_BT.detach(), torch.full((2,), advantage), mask_BT, cfg,
                              max_new_tokens=MAX_NEW)
        return torch.autograd.grad(loss, theta)[0], mask_BT

    g_a, mask_a = grad(10, -1.0)
    g_b, mask_b = grad(100, +1.0)
    assert (float(g_a), float(g_b)) == pytest.approx((1.0, -1.0))
    by_tokens = (20 * g_a + 200 * g_b) / 220
    assert float(by_tokens) == pytest.approx(-0.818, abs=1e-3)
    wa, wb = (LossNormalizer.of(m).denominator("grpo") for m in (mask_a, mask_b))
    assert (wa, wb) == (2.0, 2.0)
    assert float((wa * g_a + wb * g_b) / (wa + wb)) == pytest.approx(0.0, abs=1e-6)


CASES = [(v, {}) for v in LOSS_VARIANTS] + [("grpo", {"kl_beta": 0.05}), ("dapo", {"kl_beta": 0.05}),
                                            ("dr_grpo", {"loss_constant": 64.0})]


@pytest.mark.parametrize(("variant", "extra"), CASES, ids=[f"{v}{'-' + '-'.join(e) if e else ''}" for v, e in CASES])
def test_averaged_step_equals_the_union_step_for_every_variant(variant, extra):
    cfg = LossConfig(variant=variant, **extra)
    a = _batch([3, 9, 0, 12], [0.8, -0.4, 0.3, 1.1], seed=1)            # one empty completion
    b = _batch([40, 55, 61], [-0.9, 0.2, 0.6], seed=2)
    union = _grad(_union(a, b), cfg)
    averaged = _averaged(cfg, a, b, lambda m: LossNormalizer.of(m).denominator(variant))
    torch.testing.assert_close(averaged, union, rtol=1e-5, atol=1e-7)
    if variant not in ("dapo", "cispo"):   # the old rule (tokens) is wrong for the sequence-normalised ones
        by_tokens = _averaged(cfg, a, b, lambda m: float(m.sum()))
        assert not torch.allclose(by_tokens, union, rtol=1e-3, atol=1e-6)


def test_denominator_of_an_empty_batch_is_zero():
    empty = LossNormalizer.of(torch.zeros(3, 4, dtype=torch.bool))
    assert [empty.denominator(v) for v in LOSS_VARIANTS] == [0.0] * len(LOSS_VARIANTS)


class _Capture:
    """A gradient reducer that records what the learner would give the average and takes no step."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []
        self.weight = -1.0

    def begin(self) -> None:
        """Nothing to prepare."""

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """Record; no step (the test compares gradients, not updated weights)."""
        self.grads, self.weight = grads, weight
        return Reduced(None)


def _groups(lengths_by_group: list[list[int]], first_index: int, seed: int) -> list[pb.Group]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for i, lengths in enumerate(lengths_by_group):
        g = pb.Group(prompt_index=first_index + i, prompt_token_ids=[2, 17, 30, 41])
        for j, n in enumerate(lengths):
            ids = torch.randint(5, 200, (n,), generator=gen).tolist()
            g.completions.append(pb.Completion(token_ids=ids, logprobs=[-2.0] * n, reward=float(j % 2),
                                               rewards=[float(j % 2)], finish_reason="length", policy_version=0))
        groups.append(g)
    return groups


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo"])
def test_learner_gives_the_average_its_loss_denominator(variant, model_cache):
    """Real learners from the same initial adapter: A's and B's gradients, averaged with the weights
    the learner hands its reducer, equal the gradient of one learner on A + B."""
    spec = builtin_job("tiny", model_cache, loss={"variant": variant}, group_size=2,
                       sampling={"temperature": 1.0, "max_new_tokens": 32, "stop": []})
    path = prepare_base_model("tiny", model_cache)
    groups_a = _groups([[2, 3], [4, 2]], 0, seed=1)          # short completions
    groups_b = _groups([[20, 31], [27, 25]], 2, seed=2)      # long ones

    def captured(groups: list[pb.Group]) -> _Capture:
        torch.manual_seed(0)                                 # the same LoRA initialisation each time
        learner, cap = Learner(path, spec), _Capture()
        learner.step(groups, current_version=0, reducer=cap)
        return cap

    a, b, union = captured(groups_a), captured(groups_b), captured(groups_a + groups_b)
    expect = {"dapo": (11.0, 103.0)}.get(variant, (4.0, 4.0))    # tokens, or completions
    assert (a.weight, b.weight) == expect
    assert any(float(g.abs().max()) > 0 for g in union.grads)   # a real gradient, not zeros
    for ga, gb, gu in zip(a.grads, b.grads, union.grads, strict=True):
        torch.testing.assert_close((a.weight * ga + b.weight * gb) / (a.weight + b.weight), gu,
                                   rtol=1e-4, atol=1e-7)
