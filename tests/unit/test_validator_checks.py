"""Pure rungs of the validator's ladder: regrade, logprob, plausibility (synthetic models),
freshness, duplicates, and the keyed group draws.

Legend: C = completions, T = tokens per completion, V = vocabulary, N = C * T positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.protocol.envs.base import Grade
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import DUPLICATE, FRESHNESS, LOGPROB, PLAUSIBILITY, REGRADE
from swarmrl.validator import checks as ck
from swarmrl.validator.plausibility import completion_plausibility, log_threshold, token_stats
from swarmrl.validator.sampling import plan_group, unit_draw

NAN = math.nan


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> None:
    torch.set_num_threads(1)  # thousands of tiny tensor ops: thread hand-offs would dominate


def completion(reward: float, rewards: list[float], error: str = "", logprobs: list[float] | None = None,
               version: int = 1) -> pb.Completion:
    lps = logprobs or [-1.0, -2.0]
    return pb.Completion(token_ids=list(range(5, 5 + len(lps))), logprobs=lps, finish_reason="stop",
                         policy_version=version, rewards=rewards, reward=reward, grade_error=error)


# ---- regrade ----------------------------------------------------------------------------------

def test_regrade_honest_passes_and_inflated_fails() -> None:
    grades = [Grade(1.0, (1.0, 0.0), ""), Grade(0.0, (0.0, 0.0), "")]
    honest = [completion(1.0, [1.0, 0.0]), completion(0.0, [0.0, 0.0])]
    assert ck.check_regrade(honest, grades, 1e-6).passed
    inflated = [completion(1.0, [1.0, 0.0]), completion(1.0, [1.0, 0.0])]
    r = ck.check_regrade(inflated, grades, 1e-6)
    assert not r.passed and r.check == REGRADE and "completion 1" in r.detail


def test_regrade_per_function_lie_fails_even_with_the_right_total() -> None:
    r = ck.check_regrade([completion(1.0, [0.5, 0.5])], [Grade(1.0, (1.0, 0.0), "")], 1e-6)
    assert not r.passed and "reward function 0" in r.detail


def test_regrade_claimed_failure_is_not_cheating_but_is_flagged() -> None:
    r = ck.check_regrade([completion(NAN, [NAN, NAN], "correct: timeout after 5s")], [Grade(1.0, (1.0, 0.0), "")], 1e-6)
    assert r.passed and r.conclusive and r.soft_flags == 1


def test_regrade_claimed_reward_where_grading_fails_deterministically() -> None:
    r = ck.check_regrade([completion(1.0, [1.0, NAN])], [Grade(None, (None, None), "correct: ValueError: x")], 1e-6)
    assert not r.passed and "failed" in r.detail


def test_regrade_undecided_when_the_validators_grader_times_out() -> None:
    r = ck.check_regrade([completion(1.0, [1.0, 0.0])], [Grade(None, (None, None), "correct: timeout after 10.0s")], 1e-6)
    assert r.passed and not r.conclusive


# ---- logprob ----------------------------------------------------------------------------------

def test_logprob_rung_tolerances() -> None:
    tol = ck.LogprobTolerance.from_mean(0.05)
    assert tol.max_abs == 1.0
    assert tol.floored("float32") == tol and tol.floored("bfloat16").mean_abs == ck.HONEST_MEAN_FLOOR["bfloat16"]
    # a validator computing in float32 for a model its workers sample in bf16 keeps bf16's floor
    assert tol.floored("float32", "bfloat16") == tol.floored("bfloat16")
    honest = ck.check_logprobs([[-1.0, -2.0]], [[-1.01, -2.02]], tol)
    assert honest.passed and honest.check == LOGPROB
    one_token = ck.check_logprobs([[-1.0, -2.0]], [[-1.0, -3.5]], tol)
    assert not one_token.passed and "token 1" in one_token.detail
    drift = ck.check_logprobs([[-1.0, -2.0], [-1.0]], [[-1.2, -2.2], [-1.2]], tol)
    assert not drift.passed and "mean" in drift.detail
    assert not ck.check_logprobs([[-1.0]], [[-math.inf]], tol).passed
    with pytest.raises(ValueError):
        ck.check_logprobs([[-1.0]], [[-1.0, -2.0]], tol)


# ---- plausibility (synthetic categorical "models") --------------------------------------------

def _synthetic(c: int, t: int, v: int, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(c * t, v, generator=gen)


def _evalues(logits_NV: torch.Tensor, tokens_N: torch.Tensor, c: int, t: int) -> list:
    stats = token_stats(logits_NV, 1.0)
    lp_N = torch.log_softmax(logits_NV, -1).gather(-1, tokens_N[:, None]).squeeze(-1)
    return [completion_plausibility(lp_N[i * t:(i + 1) * t], tokens_N[i * t:(i + 1) * t], stats.slice(i * t, (i + 1) * t),
                                    low_test=True) for i in range(c)]


def test_honest_sampling_keeps_villes_bound_and_never_trips() -> None:
    c, t, v = 2000, 24, 64
    logits = _synthetic(c, t, v, 2.0, 0)
    tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=torch.Generator().manual_seed(1)).squeeze(-1)
    scores = _evalues(logits, tokens, c, t)
    high = torch.tensor([s.log_e_high for s in scores])
    low = torch.tensor([s.log_e_low for s in scores])
    assert high.max() < log_threshold() and low.max() < log_threshold()
    # Ville: P(e >= 1/a) <= a; at a = 0.05 expect at most 100 of 2000 (the bound is loose).
    assert int((high >= math.log(20)).sum()) <= 100 and int((low >= math.log(20)).sum()) <= 100
    assert ck.check_plausibility(scores, log_threshold()).passed


def test_random_and_greedy_tokens_are_implausible() -> None:
    c, t, v = 8, 24, 64
    logits = _synthetic(c, t, v, 2.0, 2)
    random_tokens = torch.randint(0, v, (c * t,), generator=torch.Generator().manual_seed(3))
    r = ck.check_plausibility(_evalues(logits, random_tokens, c, t), log_threshold())
    assert not r.passed and r.check == PLAUSIBILITY and "unlikely" in r.detail
    g = ck.check_plausibility(_evalues(logits, logits.argmax(-1), c, t), log_threshold())
    assert not g.passed and "predictable" in g.detail


def test_token_stats_match_a_float64_reference_with_and_without_zero_probabilities() -> None:
    """psi(power) = log sum_x p(x)^power, also for peaked distributions whose high powers
    underflow float32 (the fast path raises those terms to exp(-80)) and with p == 0 tokens (masked
    logits take the exact path; power 0 then counts only the tokens with p > 0)."""
    from swarmrl.validator.plausibility import LAMBDAS_HIGH, LAMBDAS_LOW

    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(6, 5000, generator=gen) * 12
    masked = peaked.clone()
    masked[:, :100] = -math.inf
    for logits, support in ((peaked, 5000), (masked, 4900)):
        stats = token_stats(logits, 0.8)
        logp = torch.log_softmax(logits.double() / 0.8, dim=-1)
        for lams, sign, got in ((LAMBDAS_HIGH, -1.0, stats.psi_high_NL), (LAMBDAS_LOW, 1.0, stats.psi_low_NL)):
            for j, lam in enumerate(lams):
                power = 1.0 + sign * lam
                want = torch.logsumexp(torch.where(torch.isfinite(logp), power * logp, -math.inf), dim=-1)
                assert torch.allclose(got[:, j].double(), want, atol=1e-4, rtol=1e-5), (support, power)
                if power == 0.0:
                    assert torch.allclose(got[:, j].double(), torch.full((6,), math.log(support), dtype=torch.double))
        assert torch.equal(stats.argmax_N, logits.argmax(-1))


# ---- freshness, duplicates --------------------------------------------------------------------

def test_freshness_window() -> None:
    lease = pb.Lease(policy_version=2)
    group = pb.Group(completions=[completion(0.0, [0.0], version=2), completion(0.0, [0.0], version=3)])
    assert ck.check_freshness(group, lease, head_version=3).passed
    future = ck.check_freshness(group, lease, head_version=2)
    assert not future.passed and future.check == FRESHNESS and "did not exist" in future.detail
    below = ck.check_freshness(group, pb.Lease(policy_version=3), head_version=5)
    assert not below.passed and "below" in below.detail


def test_duplicate_credit_goes_to_the_first_batch() -> None:
    first = ck.FirstSeen("peer-a", "batch-a", 7)
    assert ck.check_duplicate("batch-a", [first, None]).passed
    r = ck.check_duplicate("batch-b", [None, first])
    assert not r.passed and r.check == DUPLICATE and "peer-a" in r.detail
    assert ck.completion_key("j", 1, [1, 2]) != ck.completion_key("j", 2, [1, 2])
    assert ck.is_distinctive(completion(0.0, [0.0], logprobs=[-5.0] * 5))
    assert not ck.is_distinctive(completion(0.0, [0.0], logprobs=[-0.1, -0.2]))  # "7\n" twice is no copy


# ---- group draws ------------------------------------------------------------------------------

def test_group_draws_are_keyed_deterministic_and_at_rate() -> None:
    k1, k2 = b"a" * 32, b"b" * 32
    assert unit_draw(k1, "full", "batch", 3) == unit_draw(k1, "full", "batch", 3)
    assert unit_draw(k1, "full", "batch", 3) != unit_draw(k2, "full", "batch", 3)
    plans = [plan_group(k1, f"b{i}", i, 0.25) for i in range(4000)]
    share = sum(p.regrade for p in plans) / len(plans)
    assert 0.22 < share < 0.28
    assert all(p.regrade or not p.logprob for p in plans)
    assert 0.04 < sum(p.logprob for p in plans) / len(plans) < 0.085
    assert all(plan_group(k1, "x", i, 1.0).logprob for i in range(50))
    assert not any(plan_group(k1, "x", i, 0.0).regrade for i in range(50))
    with pytest.raises(ValueError):
        plan_group(k1, "x", 0, 1.5)
