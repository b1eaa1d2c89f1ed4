"""The swarm's one sampling log-prob convention (protocol/grpo/logprob_convention.py), on the
issue's 4-token vocabulary: logits [2, 1, 0, -1], sampled token 0, hand-computed values.

Legend: V = vocabulary (4), N = positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.node.inference.scoring import token_logprobs
from swarmrl.protocol.grpo.logprob_convention import (
    ConventionError,
    convention_logprob,
    from_engine,
    full_from_nucleus,
    kept_mass,
    nucleus_logprob,
    nucleus_mask,
)

LOGITS_NV = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
TOKEN_N = torch.tensor([0])


def test_tempered_not_raw_not_divided() -> None:
    tempered = convention_logprob(LOGITS_NV, TOKEN_N, 0.5).item()
    raw = convention_logprob(LOGITS_NV, TOKEN_N, 1.0).item()
    assert tempered == pytest.approx(-0.145078, abs=1e-6)
    assert raw == pytest.approx(-0.440190, abs=1e-6)
    assert raw / 0.5 == pytest.approx(-0.880379, abs=1e-6)   # "dividing the log-prob by T": wrong
    assert abs(tempered - raw / 0.5) > 0.7


def test_scorer_uses_the_convention() -> None:
    """What the trainer and the validator recompute (scoring.token_logprobs) is the convention."""
    for t in (0.5, 1.0, 0.0):
        assert token_logprobs(LOGITS_NV, TOKEN_N, t).item() == pytest.approx(
            convention_logprob(LOGITS_NV, TOKEN_N, t).item(), abs=1e-7)
    assert convention_logprob(LOGITS_NV, TOKEN_N, 0.0).item() == pytest.approx(-0.440190, abs=1e-6)  # greedy: T=1


def test_nucleus_at_top_p_085() -> None:
    assert nucleus_mask(LOGITS_NV, 1.0, 0.85).tolist() == [[True, True, False, False]]
    mass = kept_mass(LOGITS_NV, 1.0, 0.85)
    assert mass.item() == pytest.approx(0.880797, abs=1e-6)
    full = convention_logprob(LOGITS_NV, TOKEN_N, 1.0)
    renorm = nucleus_logprob(LOGITS_NV, TOKEN_N, 1.0, 0.85)
    assert full.item() == pytest.approx(-0.440190, abs=1e-6)
    assert renorm.item() == pytest.approx(-0.313262, abs=1e-6)
    assert full_from_nucleus(renorm, mass).item() == pytest.approx(full.item(), abs=1e-6)
    assert nucleus_logprob(LOGITS_NV, torch.tensor([2]), 1.0, 0.85).item() == -math.inf


def test_engine_conversion() -> None:
    """vLLM's processed_logprobs at top_p = 1 is the convention; anything unconvertible is a
    configuration error before a rollout exists, not a wrong number."""
    assert from_engine([-0.145078], "processed_logprobs", 0.5, 1.0) == [-0.145078]
    assert from_engine([-0.440190], "raw_logprobs", 1.0, 1.0) == [-0.440190]
    with pytest.raises(ConventionError, match="top_p"):
        from_engine([-0.313262], "processed_logprobs", 1.0, 0.85)
    with pytest.raises(ConventionError, match="processed_logprobs"):
        from_engine([-0.440190], "raw_logprobs", 0.5, 1.0)
    with pytest.raises(ValueError, match="finite"):
        from_engine([float("nan")], "processed_logprobs", 1.0, 1.0)
    with pytest.raises(ValueError, match="unknown"):
        from_engine([], "logits", 1.0, 1.0)
