# Legend: V = vocabulary, N = positions (tokens).
"""The swarm's one sampling log-prob convention, and conversion of engine outputs to it.

THE CONVENTION ("tempered-full-vocabulary"): a rollout's sampling log-prob of token x is

    log_softmax(logits / T)[x]        over the FULL vocabulary, float32,

with T the job's temperature (T = 0, greedy decoding, is scored at T = 1), top_p NOT applied
(no nucleus renormalisation). It is what `node.inference.scoring.tempered_log_softmax` computes
for the trainer's importance ratios and the validator's re-check, and what `HFBackend` records.
At top_p = 1 it is exactly the log-prob of the distribution the token was drawn from. At
top_p < 1 the token was drawn from the nucleus-renormalised distribution, whose log-prob is the
convention's minus log(kept mass) (`nucleus_logprob`): the convention keeps the full-vocabulary
value because the trainer's ratio pi_new / pi_old then compares two quantities computed the same
way, and the nucleus of a new policy is a different set.

Three wrong numbers an engine may hand over instead (the 4-token test in
tests/unit/test_logprob_convention.py checks each against hand-computed values):
  - the RAW log-prob, `log_softmax(logits)[x]`: temperature not applied (vLLM's default
    `logprobs_mode="raw_logprobs"`);
  - the raw log-prob divided by T: not a log-prob of anything;
  - the NUCLEUS-renormalised log-prob at top_p < 1 (vLLM's `processed_logprobs`: temperature,
    then top-k/top-p masking, then log_softmax).

vLLM 0.32 (`vllm/config/model.py: LogprobsMode`, `vllm/v1/sample/sampler.py`): the modes are
"raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"; processed values are
computed in float32 after temperature and top-k/top-p; greedy requests get temperature 1. So
`processed_logprobs` with top_p = 1 (and top_k off, no penalties) IS this convention. At
top_p < 1 the kept mass isn't reported, so a vLLM log-prob can't be converted: `from_engine`
raises `ConventionError`, a configuration error raised before any rollout is signed, never a
wrong number that would get an honest worker banned.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CONVENTION = "tempered-full-vocabulary"
ENGINE_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class ConventionError(ValueError):
    """An engine's log-probs can't be expressed in the swarm's convention (a configuration error)."""


def effective_temperature(temperature: float) -> float:
    """T used for log-probs: `temperature`, or 1.0 for greedy (0). ValueError if negative or NaN."""
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return temperature if temperature > 0.0 else 1.0


def tempered_logprobs(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """The convention over every token: `log_softmax(logits / T)` in float32, shape [..., V]."""
    return F.log_softmax(logits_NV.float() / effective_temperature(temperature), dim=-1)


def nucleus_mask(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Bool [..., V]: the top-p nucleus of softmax(logits / T), the smallest most-likely set whose
    mass reaches `top_p` (a token is in it iff the mass of the tokens more likely than it is
    < top_p; ties broken by index, as a stable sort does). ValueError unless 0 < top_p <= 1."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    probs_NV = tempered_logprobs(logits_NV, temperature).exp()
    sorted_NV, order_NV = probs_NV.sort(dim=-1, descending=True, stable=True)
    keep_sorted_NV = (sorted_NV.cumsum(-1) - sorted_NV) < top_p
    return torch.zeros_like(keep_sorted_NV).scatter(-1, order_NV, keep_sorted_NV)


def kept_mass(logits_NV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Mass of the nucleus under softmax(logits / T), float32 [...]."""
    probs_NV = tempered_logprobs(logits_NV, temperature).exp()
    return (probs_NV * nucleus_mask(logits_NV, temperature, top_p)).sum(-1)


def nucleus_logprob(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-prob of `tokens_N` under the nucleus-renormalised distribution (what a top-p sampler
    draws from): convention - log(kept mass), -inf outside the nucleus. Float32 [N]."""
    full_N = convention_logprob(logits_NV, tokens_N, temperature)
    inside_N = nucleus_mask(logits_NV, temperature, top_p).gather(-1, tokens_N.long().unsqueeze(-1)).squeeze(-1)
    renorm_N = full_N - kept_mass(logits_NV, temperature, top_p).log()
    return torch.where(inside_N, renorm_N, torch.full_like(renorm_N, -math.inf))


def convention_logprob(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float) -> torch.Tensor:
    """The convention at `tokens_N`: `log_softmax(logits / T)[token]`, float32 [N]."""
    return tempered_logprobs(logits_NV, temperature).gather(-1, tokens_N.long().unsqueeze(-1)).squeeze(-1)


def full_from_nucleus(nucleus_logprob_N: torch.Tensor, kept_mass_N: torch.Tensor) -> torch.Tensor:
    """Convention from a nucleus-renormalised log-prob and its step's kept mass: lp + log(mass)."""
    return nucleus_logprob_N.float() + kept_mass_N.float().log()


def from_engine(values: list[float], mode: str, temperature: float, top_p: float) -> list[float]:
    """Convert an engine's per-token sampled-token values, reported under `mode` (vLLM's
    `logprobs_mode`), to the convention.

    Exact cases: "processed_logprobs" at top_p = 1 (tempered, full vocabulary: identity), and
    "raw_logprobs" when the effective temperature is 1 and top_p = 1 (identity).
    Raises ConventionError for every other case (the value can't be converted without the whole
    distribution), ValueError on an unknown mode or a non-finite or positive value.
    """
    if mode not in ENGINE_MODES:
        raise ValueError(f"unknown engine log-prob mode {mode!r}; known: {ENGINE_MODES}")
    t = effective_temperature(temperature)
    if top_p < 1.0:
        raise ConventionError(
            f"{mode} at top_p={top_p} can't be converted to the {CONVENTION} convention (the engine "
            "doesn't report the nucleus's kept mass); serve jobs with top_p < 1 with the hf backend")
    if mode == "processed_logprobs" or (mode == "raw_logprobs" and t == 1.0):
        bad = [v for v in values if not (math.isfinite(v) and v <= 0.0)]
        if bad:
            raise ValueError(f"engine reported log-probs that are not finite and <= 0: {bad[:3]}")
        return [float(v) for v in values]
    raise ConventionError(f"{mode} at temperature {temperature} is not the {CONVENTION} convention; "
                          "start the engine with logprobs_mode='processed_logprobs'")
