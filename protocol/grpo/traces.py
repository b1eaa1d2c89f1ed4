# Legend: B = sequences (episodes or completions), T = tokens after the prompt (right-padded).
"""Masks of token-exact episode traces for the GRPO loss: model tokens only.

A multi-turn episode is scored like a completion (its ids after the shared first observation,
`protocol/envs/trace.py`), but only the tokens the model sampled are actions: the environment's
replies are context. So the loss mask is the trace's model mask (1 = model, 0 = environment)
AND the completion's keep flag (valid reward, not a masked truncation); `policy_loss` then
takes the policy term, the ratios, the KL term and every normalisation over model tokens only,
and advantages stay one per episode (group-relative over the group's episode rewards). An
empty trace mask means a single-turn completion: every token is the model's.

Worked example (tests/unit/test_grpo_traces.py): a two-turn episode [m m e e e m] with sampling
log-probs [a b 0 0 0 c] trains on positions 0, 1 and 5 only; under ``dapo`` its loss is the
sum of the three per-token terms over 3, not 6.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def model_mask_T(token_mask_T: Sequence[int], n: int, keep: bool = True) -> list[bool]:
    """The loss mask of one completion of `n` tokens: its model tokens when `keep`, else none.

    Raises:
        ValueError: a non-empty mask whose length is not `n`.
    """
    if token_mask_T and len(token_mask_T) != n:
        raise ValueError(f"mask of {len(token_mask_T)} entries for {n} tokens")
    if not keep:
        return [False] * n
    return [True] * n if not token_mask_T else [m == 1 for m in token_mask_T]


def pad_masks_BT(masks_B: Sequence[Sequence[bool]]) -> torch.Tensor:
    """(B, T) bool, right-padded with False (T = the longest mask)."""
    t = max((len(m) for m in masks_B), default=0)
    out_BT = torch.zeros(len(masks_B), t, dtype=torch.bool)
    for i, m in enumerate(masks_B):
        out_BT[i, :len(m)] = torch.tensor(list(m), dtype=torch.bool)
    return out_BT


def model_token_counts_B(mask_BT: torch.Tensor) -> torch.Tensor:
    """(B,) model tokens per sequence (what GRPO's per-sequence mean divides by)."""
    return mask_BT.to(torch.long).sum(-1)
