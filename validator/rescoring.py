"""Proof of inference: recompute a group's log-probs in one prefill, with plausibility statistics.

Legend: B = completions scored together, T = tokens of one completion, N = completion tokens of
the batch, V = vocabulary, L = lambdas (see plausibility.py).

The log-probs come from the trainer's own scoring functions (`node/inference/scoring.py`), so an
honest completion reproduces its sampling log-probs up to floating-point reduction order. The
completions of one group share their prompt: it is prefilled once and its KV cache reused by the
G completions (`shared_prompt_logprobs`), instead of G prefills of prompt + completion. The
plausibility statistics need the whole distribution at each position; rather than running the
model twice, a forward hook on the LM head sees the N-position logits the scorer computes (in
the scorer's row-major order) and reduces them to `TokenStats` on the spot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarmrl.node.inference.scoring import (
    completion_logprobs_chunked,
    shared_prompt_logprobs,
    unwrap_causal_lm,
)
from swarmrl.validator.plausibility import TokenStats, token_stats

MAX_TOKENS_PER_CHUNK = 16_384  # padded prompt+completion tokens per prefill (bounds activation memory)


@dataclass(frozen=True)
class Rescored:
    """One completion's recomputed log-probs `logprobs_T` and its positions' `stats`."""

    logprobs_T: torch.Tensor
    stats: TokenStats


def rescore(
    model: nn.Module,
    prompt_ids_B: list[list[int]],
    completion_ids_B: list[list[int]],
    *,
    temperature: float,
    pad_id: int,
    max_tokens_per_chunk: int = MAX_TOKENS_PER_CHUNK,
    shared_prompt: bool = True,
) -> list[Rescored]:
    """Recompute the log-probs of `completion_ids_B[b]` after `prompt_ids_B[b]` under `model`
    (a causal LM or a peft model with the wanted adapter active) at `temperature`.

    With `shared_prompt` each distinct prompt is prefilled once for all its completions
    (`shared_prompt_logprobs`); otherwise each prompt + completion is prefilled, in chunks of at
    most `max_tokens_per_chunk` padded tokens (the baseline the benchmark compares against). Returns one `Rescored` per completion. Raises
    ValueError as `completion_logprobs` does (empty prompt, out-of-vocabulary id, bad temperature).
    """
    collected: list[TokenStats] = []
    with torch.no_grad(), _head_stats(model, temperature, collected):
        if shared_prompt:
            logprobs_BT, _ = shared_prompt_logprobs(model, prompt_ids_B, completion_ids_B,
                                                    temperature=temperature, pad_id=pad_id)
        else:
            logprobs_BT, _ = completion_logprobs_chunked(
                model, prompt_ids_B, completion_ids_B, temperature=temperature, pad_id=pad_id,
                max_tokens_per_chunk=max_tokens_per_chunk,
            )
    stats = TokenStats.cat(collected)
    lengths = [len(c) for c in completion_ids_B]
    assert len(stats) == sum(lengths), (len(stats), sum(lengths))
    out, lo = [], 0
    for b, n in enumerate(lengths):
        out.append(Rescored(logprobs_BT[b, :n].detach().float().cpu(), stats.slice(lo, lo + n)))
        lo += n
    return out


@contextmanager
def _head_stats(model: nn.Module, temperature: float, sink: list[TokenStats]) -> Iterator[None]:
    """While active, every LM-head call appends the `TokenStats` of its logits to `sink`."""
    causal_lm = unwrap_causal_lm(model)
    head = causal_lm.get_output_embeddings()
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)

    def hook(_module: nn.Module, _args: Any, logits_nV: torch.Tensor) -> None:
        if softcap is not None:  # as the scorer does (Gemma's final logit soft-capping)
            logits_nV = torch.tanh(logits_nV / softcap) * softcap
        sink.append(token_stats(logits_nV.detach(), temperature if temperature > 0 else 1.0))

    handle = head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
