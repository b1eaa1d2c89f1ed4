"""Log-probs of given completion tokens under a causal LM, in one prefill (trainer and validator).

Legend: B = sequences, L = padded prompt+completion length, T = longest completion, H = hidden
size, V = vocabulary, N = completion tokens of the batch (sum of completion lengths).

The decoder runs once over each left-padded prompt+completion; the LM head runs only at the N
positions that predict completion tokens (Gemma's 262k-token head over every position would
dominate the cost). Log-probs are `log_softmax(logits.float() / temperature)` at the given
tokens (`tempered_log_softmax`, the function the HF sampler applies to its raw logits), so a
sampled completion scored here reproduces its sampling log-probs up to floating-point reduction
order: within ~2e-5 in fp32; in bf16 the logits themselves are rounded to bf16 (a step of
0.125-0.25 at |logit| 16-64), and Gemma 3 270M showed mean 0.03 / max 0.23 nats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_HEAD_CHUNK_TOKENS = 512  # N-chunk of the LM head + log_softmax: 512 x 262k fp32 = 0.5 GiB


def tempered_log_softmax(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """`log_softmax(logits.float() / temperature)` over the last dim, float32, shape [N, V].

    The one definition of a sampling log-prob (sampler and scorer both call it). Temperature 0
    (greedy) is scored at temperature 1. Raises ValueError on a negative temperature.
    """
    return F.log_softmax(logits_NV.float() / _effective_temperature(temperature), dim=-1)


def token_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float) -> torch.Tensor:
    """`tempered_log_softmax(logits, temperature)[n, tokens[n]]`, float32, shape [N]."""
    logp_NV = tempered_log_softmax(logits_NV, temperature)
    return logp_NV.gather(-1, tokens_N.long().unsqueeze(-1)).squeeze(-1)


def completion_logprobs(
    model: nn.Module,
    prompt_ids_B: list[list[int]],
    completion_ids_B: list[list[int]],
    *,
    temperature: float,
    pad_id: int,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of `completion_ids_B[b]` after `prompt_ids_B[b]`, one forward pass.

    model: a transformers causal LM or a peft model around one (its active adapter is used;
        inside `disable_adapter()` the base model). Put it in eval mode unless you want LoRA
        dropout in the scores.
    Returns `(logprobs_BT, mask_BT)`: float32 log-probs right-padded with 0.0 to the longest
    completion, and a bool mask of the real tokens. `logprobs_BT` is differentiable w.r.t. the
    model's trainable parameters when grad is enabled (the LM head runs per chunk of
    `head_chunk_tokens` positions, to bound memory; a frozen head's gradient w.r.t. the hidden
    states is computed in that same pass, `_HeadLogprob`, a trainable one is recomputed in backward).
    Raises ValueError on mismatched batch sizes, empty prompts, out-of-vocabulary ids or a
    negative temperature.
    """
    _check_inputs(model, prompt_ids_B, completion_ids_B, pad_id)
    _effective_temperature(temperature)
    device = _model_device(model)
    input_ids_BL, attention_BL, position_BL = _left_pad(prompt_ids_B, completion_ids_B, pad_id, device)
    rows_N, cols_N, tokens_N, mask_BT = _completion_positions(prompt_ids_B, completion_ids_B, device)
    if tokens_N.numel() == 0:
        return torch.zeros(mask_BT.shape, dtype=torch.float32, device=device), mask_BT
    causal_lm = unwrap_causal_lm(model)
    decoder = causal_lm.get_decoder()
    hidden_BLH = decoder(
        input_ids=input_ids_BL, attention_mask=attention_BL, position_ids=position_BL, use_cache=False
    ).last_hidden_state
    hidden_NH = hidden_BLH[rows_N, cols_N - 1]  # the position before a token predicts it
    logprobs_N = _head_logprobs(causal_lm, hidden_NH, tokens_N, temperature, head_chunk_tokens)
    logprobs_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=device)
    return logprobs_BT.masked_scatter(mask_BT, logprobs_N), mask_BT


def shared_prompt_logprobs(
    model: nn.Module,
    prompt_ids_B: list[list[int]],
    completion_ids_B: list[list[int]],
    *,
    temperature: float,
    pad_id: int,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` with each distinct prompt prefilled once: the U distinct prompts run
    left-padded with a KV cache, the cache rows are gathered per completion, and the B
    right-padded completions run together over it, as a sampler decodes a group. For GRPO's
    groups (G completions per prompt) that is U*P + B*T decoder positions instead of B*(P + T)
    (P = longest prompt, T = longest completion).

    Same result and shapes as `completion_logprobs` up to floating-point reduction order, and
    differentiable the same way (gradients reach the LoRA weights through the prompt's keys and
    values too). The technique is autoregressive decoding's KV cache, reused across the samples
    of one prompt (as vLLM's automatic prefix caching reuses it across requests).
    Returns `(logprobs_BT, mask_BT)`. Raises ValueError as `completion_logprobs` does.
    """
    _check_inputs(model, prompt_ids_B, completion_ids_B, pad_id)
    _effective_temperature(temperature)
    device = _model_device(model)
    lengths_B = torch.tensor([len(c) for c in completion_ids_B], dtype=torch.long)
    t_max = int(lengths_B.max()) if len(completion_ids_B) else 0
    mask_BT = (torch.arange(t_max).unsqueeze(0) < lengths_B.unsqueeze(1)).to(device)
    if t_max == 0:
        return torch.zeros(mask_BT.shape, dtype=torch.float32, device=device), mask_BT
    distinct: dict[tuple[int, ...], int] = {}
    row_prompt_B = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids_B],
                                dtype=torch.long, device=device)
    prompts_U = [list(p) for p in distinct]
    causal_lm = unwrap_causal_lm(model)
    decoder = causal_lm.get_decoder()
    ids_UP, attention_UP, position_UP = _left_pad(prompts_U, [[] for _ in prompts_U], pad_id, device)
    prefill = decoder(input_ids=ids_UP, attention_mask=attention_UP, position_ids=position_UP, use_cache=True)
    cache = prefill.cache
    cache.batch_select_indices(row_prompt_B)          # one cache row per completion (differentiable gather)
    ids_BT = torch.full((len(completion_ids_B), t_max), pad_id, dtype=torch.long)
    for b, c in enumerate(completion_ids_B):
        ids_BT[b, : len(c)] = torch.tensor(c, dtype=torch.long)
    ids_BT = ids_BT.to(device)
    prompt_len_B = attention_UP.sum(-1)[row_prompt_B]
    attention_BL = torch.cat([attention_UP[row_prompt_B], mask_BT.long()], dim=1)
    position_BT = prompt_len_B.unsqueeze(1) + torch.arange(t_max, device=device).unsqueeze(0)
    hidden_BTH = decoder(input_ids=ids_BT, attention_mask=attention_BL, position_ids=position_BT,
                         cache=cache, use_cache=True).last_hidden_state
    last_prompt_BH = prefill.last_hidden_state[:, -1][row_prompt_B]   # left-padded: the last column is real
    predictors_BTH = torch.cat([last_prompt_BH.unsqueeze(1), hidden_BTH[:, :-1]], dim=1)
    logprobs_N = _head_logprobs(causal_lm, predictors_BTH[mask_BT], ids_BT[mask_BT], temperature,
                                head_chunk_tokens)   # row-major, as completion_logprobs
    logprobs_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=device)
    return logprobs_BT.masked_scatter(mask_BT, logprobs_N), mask_BT


def completion_logprobs_chunked(
    model: nn.Module,
    prompt_ids_B: list[list[int]],
    completion_ids_B: list[list[int]],
    *,
    temperature: float,
    pad_id: int,
    max_tokens_per_chunk: int,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_logprobs` over consecutive groups of sequences, each group's padded size
    (rows x longest prompt+completion) at most `max_tokens_per_chunk` (a longer single sequence
    forms its own group). Same result and shapes as one call.

    This bounds activation memory under `torch.no_grad()` (validator). With grad enabled every
    group's graph is kept until backward; a trainer that must bound memory calls
    `completion_logprobs` per group and runs backward per group instead.
    Raises ValueError as `completion_logprobs` does, or on `max_tokens_per_chunk < 1`.
    """
    if max_tokens_per_chunk < 1:
        raise ValueError(f"max_tokens_per_chunk must be >= 1, got {max_tokens_per_chunk}")
    if len(prompt_ids_B) != len(completion_ids_B):
        raise ValueError(f"{len(prompt_ids_B)} prompts but {len(completion_ids_B)} completions")
    t_max = max((len(c) for c in completion_ids_B), default=0)
    parts_lp, parts_mask = [], []
    for lo, hi in _row_groups(prompt_ids_B, completion_ids_B, max_tokens_per_chunk):
        lp_bT, mask_bT = completion_logprobs(
            model, prompt_ids_B[lo:hi], completion_ids_B[lo:hi],
            temperature=temperature, pad_id=pad_id, head_chunk_tokens=head_chunk_tokens,
        )
        parts_lp.append(F.pad(lp_bT, (0, t_max - lp_bT.shape[1])))
        parts_mask.append(F.pad(mask_bT, (0, t_max - mask_bT.shape[1])))
    if not parts_lp:
        device = _model_device(model)
        return torch.zeros((0, 0), device=device), torch.zeros((0, 0), dtype=torch.bool, device=device)
    return torch.cat(parts_lp), torch.cat(parts_mask)


def _effective_temperature(temperature: float) -> float:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return temperature if temperature > 0.0 else 1.0


def unwrap_causal_lm(model: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (LoRA layers are injected in place), or
    `model` itself. Duck-typed: any module with `get_decoder`, `get_output_embeddings` and
    `config` as transformers' causal LMs have them will do."""
    get_base = getattr(model, "get_base_model", None)
    return cast("PreTrainedModel", get_base() if callable(get_base) else model)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_inputs(
    model: nn.Module, prompt_ids_B: list[list[int]], completion_ids_B: list[list[int]], pad_id: int
) -> None:
    if len(prompt_ids_B) != len(completion_ids_B):
        raise ValueError(f"{len(prompt_ids_B)} prompts but {len(completion_ids_B)} completions")
    vocab = cast(nn.Embedding, unwrap_causal_lm(model).get_input_embeddings()).num_embeddings
    if not 0 <= pad_id < vocab:
        raise ValueError(f"pad_id {pad_id} outside the vocabulary [0, {vocab})")
    for b, (p, c) in enumerate(zip(prompt_ids_B, completion_ids_B, strict=True)):
        if not p:
            raise ValueError(f"prompt {b} is empty")
        if any(not 0 <= t < vocab for t in p) or any(not 0 <= t < vocab for t in c):
            raise ValueError(f"sequence {b} has a token id outside the vocabulary [0, {vocab})")


def _left_pad(
    prompt_ids_B: list[list[int]], completion_ids_B: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, attention mask and position ids (0 at each row's first real token)."""
    seqs = [p + c for p, c in zip(prompt_ids_B, completion_ids_B, strict=True)]
    length = max(len(s) for s in seqs)
    input_ids_BL = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention_BL = torch.zeros((len(seqs), length), dtype=torch.long)
    for b, s in enumerate(seqs):
        input_ids_BL[b, length - len(s):] = torch.tensor(s, dtype=torch.long)
        attention_BL[b, length - len(s):] = 1
    position_BL = (attention_BL.cumsum(-1) - 1).clamp(min=0)
    return input_ids_BL.to(device), attention_BL.to(device), position_BL.to(device)


def _completion_positions(
    prompt_ids_B: list[list[int]], completion_ids_B: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, column in the left-padded batch, token id) of every completion token, row-major,
    and the right-padded [B, T] mask they fill in that order."""
    length = max(len(p) + len(c) for p, c in zip(prompt_ids_B, completion_ids_B, strict=True))
    t_max = max((len(c) for c in completion_ids_B), default=0)
    rows: list[int] = []
    cols: list[int] = []
    tokens: list[int] = []
    mask_BT = torch.zeros((len(completion_ids_B), t_max), dtype=torch.bool)
    for b, c in enumerate(completion_ids_B):
        rows += [b] * len(c)
        cols += range(length - len(c), length)
        tokens += c
        mask_BT[b, : len(c)] = True
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return as_long(rows), as_long(cols), as_long(tokens), mask_BT.to(device)


def _head_logprobs(
    causal_lm: PreTrainedModel, hidden_NH: torch.Tensor, tokens_N: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """LM head (+ Gemma's final logit soft-capping) and `token_logprobs`, `chunk` rows at a time.

    A frozen linear head (every LoRA job's) goes through `_HeadLogprob`, which never keeps or
    recomputes a chunk's logits for backward; a trainable or non-linear head is recomputed per
    chunk in backward (activation checkpointing).
    """
    if chunk < 1:
        raise ValueError(f"head_chunk_tokens must be >= 1, got {chunk}")
    head = causal_lm.get_output_embeddings()
    softcap = getattr(causal_lm.config, "final_logit_softcapping", None)
    recompute = torch.is_grad_enabled() and hidden_NH.requires_grad
    if recompute and _frozen_linear(head):
        out = _HeadLogprob.apply(hidden_NH, head.weight, head.bias, tokens_N, temperature, softcap, chunk)
        return cast(torch.Tensor, out)

    def one_chunk(h_nH: torch.Tensor, tok_n: torch.Tensor) -> torch.Tensor:
        return token_logprobs(_softcapped(head(h_nH), softcap), tok_n, temperature)

    parts = []
    for lo in range(0, hidden_NH.shape[0], chunk):
        h_nH, tok_n = hidden_NH[lo: lo + chunk], tokens_N[lo: lo + chunk]
        parts.append(checkpoint(one_chunk, h_nH, tok_n, use_reentrant=False) if recompute else one_chunk(h_nH, tok_n))
    return torch.cat(parts)


def _frozen_linear(head: nn.Module) -> bool:
    """Whether `head` is a plain linear layer with no trainable parameter (`_HeadLogprob` applies)."""
    return isinstance(head, nn.Linear) and not any(p.requires_grad for p in head.parameters())


def _softcapped(logits_nV: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return logits_nV if softcap is None else torch.tanh(logits_nV / softcap) * softcap


class _HeadLogprob(torch.autograd.Function):
    """`token_logprobs(softcap(hidden @ W.T + b), tokens, temperature)` for a frozen head, in chunks
    of rows, with the gradient w.r.t. `hidden` computed in forward.

    Per chunk the [n, V] logits exist once: the log-probs are read from them, and so is
    d logp_n / d hidden_n = ((onehot(token_n) - softmax_n) / temperature
    * (1 - tanh^2(logits_n / softcap))) @ W, an [n, H] tensor kept for backward (N x H floats
    instead of N x V logits, and no second head pass in backward, as checkpointing costs).
    Backward scales those rows by the incoming gradient. Only the hidden states get a gradient:
    the head is frozen (`_head_logprobs` checks, and calls this only when `hidden` needs one).
    The values are the plain path's (same dtype, same operations); the gradient is computed in
    float32 up to the product with W, which runs in W's dtype as autograd's would.
    The idea is fused linear + cross-entropy as Liger-Kernel does it (grad in forward, chunked).
    """

    @staticmethod
    def forward(ctx: Any, hidden_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                tokens_N: torch.Tensor, temperature: float, softcap: float | None, chunk: int) -> torch.Tensor:
        t = _effective_temperature(temperature)
        logprobs, grads = [], []
        for lo in range(0, hidden_NH.shape[0], chunk):
            h_nH, tok_n = hidden_NH[lo: lo + chunk].contiguous(), tokens_N[lo: lo + chunk].long()
            logits_nV = _softcapped(F.linear(h_nH, weight_VH, bias_V), softcap)
            logp_nV = tempered_log_softmax(logits_nV, temperature)
            logprobs.append(logp_nV.gather(-1, tok_n.unsqueeze(-1)).squeeze(-1))
            grad_nV = logp_nV.exp_().neg_()                     # -softmax, in place of logp
            grad_nV.scatter_add_(-1, tok_n.unsqueeze(-1), torch.ones_like(grad_nV[:, :1]))
            grad_nV.mul_(1.0 / t)
            if softcap is not None:
                grad_nV.mul_(1.0 - (logits_nV.float() / softcap).square())
            grads.append(grad_nV.to(weight_VH.dtype) @ weight_VH)
            del logits_nV, logp_nV
        ctx.save_for_backward(torch.cat(grads).to(hidden_NH.dtype))
        return torch.cat(logprobs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (dlogp_dh_NH,) = ctx.saved_tensors
        grad_N = grad_outputs[0]
        return (grad_N.unsqueeze(-1).to(dlogp_dh_NH.dtype) * dlogp_dh_NH, None, None, None, None, None, None)


def _row_groups(
    prompt_ids_B: list[list[int]], completion_ids_B: list[list[int]], budget: int
) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) row ranges whose padded size rows x longest row stays within budget."""
    groups: list[tuple[int, int]] = []
    lo, longest = 0, 0
    for b, (p, c) in enumerate(zip(prompt_ids_B, completion_ids_B, strict=True)):
        longest_with_b = max(longest, len(p) + len(c))
        if b > lo and (b - lo + 1) * longest_with_b > budget:
            groups.append((lo, b))
            lo, longest_with_b = b, len(p) + len(c)
        longest = longest_with_b
    if len(prompt_ids_B) > lo:
        groups.append((lo, len(prompt_ids_B)))
    return groups
