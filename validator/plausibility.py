"""Are these tokens plausible samples of the model at the job's temperature? E-value tests.

Legend: N = scored positions (completion tokens), V = vocabulary, L = lambdas of one family,
T = tokens of one completion.

Let p_t = softmax(logits_t / temperature) be the model's sampling distribution at step t and
s_t = -log p_t(x_t) the surprisal of the sampled token. For any lambda, under honest sampling

    E[exp(lambda * s_t - psi_t(lambda)) | prefix] = 1,   psi_t(lambda) = log sum_x p_t(x)^(1 - lambda),

so M(lambda) = prod_t exp(lambda * s_t - psi_t(lambda)) is a test martingale (the completion ends
at a stopping time: EOS, a stop string or the length cap). By Ville's inequality
P(sup M >= 1/alpha) <= alpha, whatever the model: the false-alarm probability of flagging an honest
completion is at most alpha, with no distributional assumption. (Shafer and Vovk, "Game-Theoretic
Foundations for Probability and Finance", 2019; Ramdas et al., "Game-theoretic statistics and
safe anytime-valid inference", Statistical Science 2023.)

- *Too surprising* (random tokens, another model's tokens): lambda > 0 ("high" family). lambda = 1
  is the likelihood ratio of the uniform distribution against the model: psi = log V.
- *Too predictable* (greedy decoding passed off as sampling): lambda < 0, written here as
  M_low(l) = prod_t exp(l * log p_t(x_t) - log sum_x p_t(x)^(1 + l)) for l > 0 ("low" family).
  As l grows it tends to prod_t 1{x_t = argmax} / max_x p_t(x): the probability that honest
  sampling picks the argmax at every step, inverted.

A family's e-value is the mean of its members' (a mean of e-values is an e-value); the two
families are combined by a union bound, so a completion is flagged when either mixture reaches
`tests / alpha`.

Top-p: nucleus sampling only makes high-probability tokens likelier, so the "too surprising" test
stays valid (its bound only gets more conservative); the "too predictable" test does not, and is
skipped when top_p < 1. The caller passes the model's own (recomputed) log-probs, never the
worker's claims.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from swarmrl.node.inference.scoring import tempered_log_softmax

LAMBDAS_HIGH = (0.5, 1.0)
LAMBDAS_LOW = (1.0, 8.0)
DEFAULT_ALPHA = 1e-9
TESTS = 2  # the two families, combined by a union bound
_ROWS_PER_PASS = 64  # positions per log_softmax pass (Gemma: 64 x 262k fp32 = 64 MiB)
_UNDERFLOW = -80.0   # exp(-80) = 1.8e-35: the smallest term _psi keeps apart (float32 is normal to ~1e-38)


@dataclass(frozen=True)
class TokenStats:
    """Per-position statistics of the sampling distribution (what the e-values need).

    psi_high_NL[n, l] = log sum_x p_n(x)^(1 - LAMBDAS_HIGH[l]);
    psi_low_NL[n, l] = log sum_x p_n(x)^(1 + LAMBDAS_LOW[l]);
    argmax_N[n] = the most likely token at position n.
    """

    psi_high_NL: torch.Tensor
    psi_low_NL: torch.Tensor
    argmax_N: torch.Tensor

    def __len__(self) -> int:
        return int(self.argmax_N.shape[0])

    def slice(self, lo: int, hi: int) -> TokenStats:
        """Positions [lo, hi)."""
        return TokenStats(self.psi_high_NL[lo:hi], self.psi_low_NL[lo:hi], self.argmax_N[lo:hi])

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        """Concatenate along positions (an empty list gives zero positions)."""
        if not parts:
            return TokenStats(torch.zeros(0, len(LAMBDAS_HIGH)), torch.zeros(0, len(LAMBDAS_LOW)),
                              torch.zeros(0, dtype=torch.long))
        return TokenStats(torch.cat([p.psi_high_NL for p in parts]), torch.cat([p.psi_low_NL for p in parts]),
                          torch.cat([p.argmax_N for p in parts]))


def token_stats(logits_NV: torch.Tensor, temperature: float) -> TokenStats:
    """`TokenStats` of `softmax(logits / temperature)` at each of the N positions (float32, CPU).

    Uses the sampler's and scorer's own `tempered_log_softmax`. Raises ValueError on a
    non-positive temperature.
    """
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    high = torch.tensor([1.0 - lam for lam in LAMBDAS_HIGH])
    low = torch.tensor([1.0 + lam for lam in LAMBDAS_LOW])
    parts = []
    with torch.no_grad():
        for lo in range(0, logits_NV.shape[0], _ROWS_PER_PASS):
            logp_nV = tempered_log_softmax(logits_NV[lo: lo + _ROWS_PER_PASS], temperature).cpu()
            parts.append(TokenStats(_psi(logp_nV, high), _psi(logp_nV, low), logp_nV.argmax(dim=-1)))
    return TokenStats.cat(parts)


def _psi(logp_nV: torch.Tensor, powers_L: torch.Tensor) -> torch.Tensor:
    """[n, L]: log sum_x exp(power * logp(x)) over the tokens with p > 0 (0 * -inf is not NaN).

    Powers are >= 0. Terms below exp(_UNDERFLOW) times the largest one are raised to it: they
    would be subnormal floats, which cost the CPU ~10x per exp, and together they change the sum
    by less than V * exp(-80) relative (far below float32 resolution).
    """
    if not bool(logp_nV.min() > -math.inf):   # some p == 0 (masked logits): the exact, slower way
        finite_nV = torch.isfinite(logp_nV)
        out = [torch.logsumexp(torch.where(finite_nV, power * logp_nV, -math.inf), dim=-1)
               for power in powers_L.tolist()]
        return torch.stack(out, dim=-1)
    max_n1 = logp_nV.max(dim=-1, keepdim=True).values
    shifted_nV = logp_nV - max_n1
    out = []
    for power in powers_L.tolist():
        if power == 0.0:   # every token counts 1
            out.append(torch.full((logp_nV.shape[0],), math.log(logp_nV.shape[-1]), dtype=logp_nV.dtype))
            continue
        terms_nV = torch.mul(shifted_nV, power).clamp_(min=_UNDERFLOW).exp_()
        out.append(terms_nV.sum(dim=-1).log_() + power * max_n1[:, 0])
    return torch.stack(out, dim=-1)


@dataclass(frozen=True)
class Plausibility:
    """The two log e-values of one completion (natural log; flag at `log_threshold`).

    log_e_high: evidence the tokens are *less* likely than samples of the model (random tokens).
    log_e_low: evidence they are *more* likely (greedy); None when the test does not apply.
    argmax_fraction: share of tokens that are the model's argmax (for the detail line).
    """

    log_e_high: float
    log_e_low: float | None
    argmax_fraction: float
    tokens: int


def log_threshold(alpha: float = DEFAULT_ALPHA) -> float:
    """log(TESTS / alpha): flag when a family's log e-value reaches this. Raises ValueError on a bad alpha."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return math.log(TESTS / alpha)


def completion_plausibility(
    logprobs_T: torch.Tensor, tokens_T: torch.Tensor, stats: TokenStats, *, low_test: bool
) -> Plausibility:
    """E-values of one completion from its recomputed log-probs and per-position `stats`.

    logprobs_T: recomputed `log p_t(x_t)` [T]; tokens_T: the token ids [T]; stats: T positions.
    low_test: run the "too predictable" family (valid only for top_p == 1).
    Raises ValueError when the lengths differ.
    """
    if not len(logprobs_T) == len(tokens_T) == len(stats):
        raise ValueError(f"lengths differ: {len(logprobs_T)} log-probs, {len(tokens_T)} tokens, {len(stats)} stats")
    lp_T1 = logprobs_T.double().unsqueeze(-1)
    high_L = torch.tensor(LAMBDAS_HIGH, dtype=torch.float64)
    low_L = torch.tensor(LAMBDAS_LOW, dtype=torch.float64)
    log_m_high_L = (-high_L * lp_T1 - stats.psi_high_NL.double()).sum(dim=0)
    log_e_high = _log_mean_exp(log_m_high_L)
    log_e_low = None
    if low_test:
        log_m_low_L = (low_L * lp_T1 - stats.psi_low_NL.double()).sum(dim=0)
        log_e_low = _log_mean_exp(log_m_low_L)
    n = len(tokens_T)
    argmax_fraction = float((stats.argmax_N == tokens_T.long()).double().mean()) if n else 0.0
    return Plausibility(log_e_high, log_e_low, argmax_fraction, n)


def _log_mean_exp(x_L: torch.Tensor) -> float:
    if x_L.numel() == 0:
        return -math.inf
    return float(torch.logsumexp(x_L, dim=0) - math.log(x_L.numel()))
