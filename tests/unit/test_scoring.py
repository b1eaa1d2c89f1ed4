"""completion_logprobs on tiny random models against a naive full-logits computation.

Legend: B = sequences, T = longest completion, V = vocabulary.
"""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from swarmrl.node.inference.scoring import (
    completion_logprobs,
    completion_logprobs_chunked,
    shared_prompt_logprobs,
    token_logprobs,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 300
PAD = 0
PROMPTS = [[1, 5, 9, 33], [1, 7], [1, 250, 251, 252, 253, 254, 17]]
COMPLETIONS = [[44, 45, 2], [8, 9, 10, 11, 12, 13], [299]]


def llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=VOCAB, pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def gemma3(seed: int = 0) -> transformers.Gemma3ForCausalLM:
    """Gemma 3 shape in miniature: sliding-window layers, embedding scaling, logit soft-capping."""
    config = transformers.Gemma3TextConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        intermediate_size=128, vocab_size=VOCAB, pad_token_id=PAD, sliding_window=4,
        final_logit_softcapping=3.0, initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return transformers.Gemma3ForCausalLM(config).eval()


def with_lora(model: torch.nn.Module, seed: int = 1) -> peft.PeftModel:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    pm = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    for name, p in pm.named_parameters():
        if "lora_B" in name:
            p.data = 0.3 * torch.randn(p.shape, generator=gen)
    return pm


def naive(model: torch.nn.Module, prompts, completions, temperature: float) -> list[torch.Tensor]:
    """Per sequence, unpadded: full-sequence logits, log_softmax, gather."""
    out = []
    for p, c in zip(prompts, completions, strict=True):
        logits_LV = model(input_ids=torch.tensor([p + c])).logits[0].float()
        logp_LV = torch.log_softmax(logits_LV / temperature, dim=-1)
        out.append(logp_LV[len(p) - 1: len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None])[:, 0])
    return out


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_naive_full_logits(make, temperature: float) -> None:
    model = make()
    with torch.no_grad():
        logprobs_BT, mask_BT = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=temperature, pad_id=PAD)
        ref = naive(model, PROMPTS, COMPLETIONS, temperature)
    assert logprobs_BT.dtype == torch.float32 and mask_BT.dtype == torch.bool
    assert logprobs_BT.shape == mask_BT.shape == (3, 6)
    for b, c in enumerate(COMPLETIONS):
        assert mask_BT[b].tolist() == [True] * len(c) + [False] * (6 - len(c))
        assert torch.allclose(logprobs_BT[b, : len(c)], ref[b], rtol=0.0, atol=1e-5)
        assert (logprobs_BT[b, len(c):] == 0.0).all()


def test_head_runs_only_at_completion_positions() -> None:
    model = llama()
    rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape))
    with torch.no_grad():
        completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD)
    assert sum(shape[0] for shape in rows) == sum(len(c) for c in COMPLETIONS)
    assert all(len(shape) == 2 for shape in rows)


def test_empty_completion_and_greedy_temperature() -> None:
    model = llama()
    with torch.no_grad():
        lp_BT, mask_BT = completion_logprobs(model, PROMPTS, [[], [3], []], temperature=0.0, pad_id=PAD)
        ref = naive(model, [PROMPTS[1]], [[3]], 1.0)[0]
        none_BT, none_mask = completion_logprobs(model, PROMPTS[:1], [[]], temperature=1.0, pad_id=PAD)
    assert mask_BT.tolist() == [[False], [True], [False]]
    assert torch.allclose(lp_BT[1, :1], ref, atol=1e-5)
    assert none_BT.shape == none_mask.shape == (1, 0)


@pytest.mark.parametrize("head_chunk_tokens", [512, 3])
def test_gradient_reaches_lora_and_matches_naive(head_chunk_tokens: int) -> None:
    model = with_lora(llama())
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    logprobs_BT, mask_BT = completion_logprobs(
        model, PROMPTS, COMPLETIONS, temperature=0.8, pad_id=PAD, head_chunk_tokens=head_chunk_tokens
    )
    assert logprobs_BT.requires_grad
    grads = torch.autograd.grad(logprobs_BT[mask_BT].sum(), lora)
    ref_grads = torch.autograd.grad(torch.cat(naive(model, PROMPTS, COMPLETIONS, 0.8)).sum(), lora)
    assert any(g.abs().sum() > 0 for g in grads)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-5)


def test_adapter_and_disabled_adapter() -> None:
    model = with_lora(llama())
    with torch.no_grad():
        lora_BT, _ = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD)
        with model.disable_adapter():
            base_BT, _ = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD)
    plain_BT, _ = completion_logprobs(llama(), PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD)
    assert torch.allclose(base_BT, plain_BT, atol=1e-6)
    assert not torch.allclose(lora_BT, base_BT, atol=1e-3)


@pytest.mark.parametrize("budget", [1, 12, 20, 10_000])
def test_chunked_equals_one_call(budget: int) -> None:
    model = llama()
    with torch.no_grad():
        whole = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD)
        chunked = completion_logprobs_chunked(
            model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD, max_tokens_per_chunk=budget
        )
    assert torch.equal(whole[1], chunked[1])
    assert torch.allclose(whole[0], chunked[0], atol=1e-5)


GROUP_PROMPT = [1, 250, 251, 252, 253, 254, 17, 30, 31]   # longer than gemma3()'s sliding window
GROUP = [[44, 45, 2], [8, 9, 10, 11, 12, 13], [299], [], [44, 45, 2]]
# Two groups with different prompt lengths, interleaved (rows need not be sorted by prompt).
MIXED_PROMPTS = [GROUP_PROMPT, [1, 7], GROUP_PROMPT, [1, 7], [1, 7]]
MIXED = [[44, 45, 2], [8, 9, 10], [299], [5], [12, 13, 14, 15, 16, 17, 18]]
LORA_MODELS = [llama, gemma3, lambda: with_lora(llama()), lambda: with_lora(gemma3())]


@pytest.mark.parametrize("make", LORA_MODELS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_shared_prompt_matches_naive_and_per_sequence_prefill(make, temperature: float) -> None:
    """Each distinct prompt prefilled once + the completions over its gathered KV cache give the
    same log-probs as full sequences (past a sliding window, with LoRA, with an empty and a
    duplicated completion, and with two interleaved prompts of different lengths)."""
    model = make()
    for prompts, completions in (([GROUP_PROMPT] * len(GROUP), GROUP), (MIXED_PROMPTS, MIXED)):
        with torch.no_grad():
            shared_BT, mask_BT = shared_prompt_logprobs(model, prompts, completions, temperature=temperature,
                                                        pad_id=PAD)
            full_BT, full_mask = completion_logprobs(model, prompts, completions, temperature=temperature,
                                                     pad_id=PAD)
            ref = naive(model, prompts, completions, temperature)
        assert torch.equal(mask_BT, full_mask) and mask_BT.sum(1).tolist() == [len(c) for c in completions]
        assert torch.allclose(shared_BT, full_BT, atol=1e-5)
        for b, r in enumerate(ref):
            assert torch.allclose(shared_BT[b, : len(r)], r, atol=1e-5)
        assert (shared_BT[~mask_BT] == 0).all()


@pytest.mark.parametrize("make", [lambda: with_lora(llama()), lambda: with_lora(gemma3())])
def test_shared_prompt_gradients_match_per_sequence_prefill(make) -> None:
    """The LoRA gradients of a loss over the log-probs are the same either way: they reach the
    adapter through the shared prompt's keys and values too."""
    grads = []
    for fn in (completion_logprobs, shared_prompt_logprobs):
        model = make()
        model.train()
        lp_BT, mask_BT = fn(model, MIXED_PROMPTS, MIXED, temperature=1.0, pad_id=PAD)
        weights_BT = torch.linspace(-1.0, 1.0, lp_BT.numel()).reshape(lp_BT.shape)
        (lp_BT * weights_BT * mask_BT).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[0])
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], rtol=1e-4, atol=1e-6), n
    assert any(float(g.abs().max()) > 0 for n, g in grads[0].items() if "lora_B" in n)


def test_shared_prompt_with_nothing_to_score_and_bad_inputs() -> None:
    model = llama()
    with torch.no_grad():
        lp_BT, mask_BT = shared_prompt_logprobs(model, [[1, 2]] * 2, [[], []], temperature=1.0, pad_id=PAD)
    assert lp_BT.shape == mask_BT.shape == (2, 0)
    for prompts, completions in (([[]], [[1]]), ([[1]], [[VOCAB]]), ([[1], [1]], [[2]])):
        with pytest.raises(ValueError):
            shared_prompt_logprobs(model, prompts, completions, temperature=1.0, pad_id=PAD)


def test_bad_inputs_raise() -> None:
    model = llama()
    cases = [
        {"prompt_ids_B": PROMPTS, "completion_ids_B": COMPLETIONS[:2]},
        {"prompt_ids_B": [[]], "completion_ids_B": [[1]]},
        {"prompt_ids_B": [[1]], "completion_ids_B": [[VOCAB]]},
        {"prompt_ids_B": [[-1]], "completion_ids_B": [[1]]},
    ]
    for case in cases:
        with pytest.raises(ValueError):
            completion_logprobs(model, **case, temperature=1.0, pad_id=PAD)
    with pytest.raises(ValueError):
        completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=-1.0, pad_id=PAD)
    with pytest.raises(ValueError):
        completion_logprobs_chunked(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD, max_tokens_per_chunk=0)


@pytest.mark.parametrize("make", [llama, gemma3])
@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 512), (0.6, 3), (0.0, 1)])
def test_frozen_head_function_matches_checkpointed_head(make, temperature: float, chunk: int) -> None:
    """`_HeadLogprob` (gradient w.r.t. the hidden states computed in forward, no logits kept)
    gives the plain path's log-probs and the same gradients, w.r.t. the hidden states and the
    LoRA weights, in fp32 (with Gemma's soft-capping, a temperature, chunks of a few rows)."""
    from swarmrl.node.inference import scoring

    model = with_lora(make())
    causal_lm = scoring.unwrap_causal_lm(model)
    torch.manual_seed(3)
    hidden_NH = torch.randn(10, 64, requires_grad=True)
    tokens_N = torch.randint(0, VOCAB, (10,))
    weights_N = torch.linspace(-1.0, 2.0, 10)
    fast_N = scoring._head_logprobs(causal_lm, hidden_NH, tokens_N, temperature, chunk)
    (fast_grad,) = torch.autograd.grad((fast_N * weights_N).sum(), hidden_NH)
    head, softcap = causal_lm.get_output_embeddings(), getattr(causal_lm.config, "final_logit_softcapping", None)
    plain_N = token_logprobs(scoring._softcapped(head(hidden_NH), softcap), tokens_N, temperature)
    (plain_grad,) = torch.autograd.grad((plain_N * weights_N).sum(), hidden_NH)
    assert fast_N.grad_fn is not None and type(fast_N.grad_fn).__name__ == "_HeadLogprobBackward"
    assert torch.allclose(fast_N, plain_N, rtol=0.0, atol=1e-6)
    assert torch.allclose(fast_grad, plain_grad, rtol=1e-5, atol=1e-6)

    grads = {}
    for use_function in (True, False):
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        head.weight.requires_grad_(not use_function)   # a trainable head takes the checkpointed path
        lp_BT, mask_BT = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=temperature, pad_id=PAD,
                                             head_chunk_tokens=chunk)
        grads[use_function] = (lp_BT.detach(), torch.autograd.grad((lp_BT * mask_BT).sum(), lora))
    head.weight.requires_grad_(False)
    assert torch.allclose(grads[True][0], grads[False][0], rtol=0.0, atol=1e-6)
    for g, r in zip(grads[True][1], grads[False][1], strict=True):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-5), (float((g - r).abs().max()), float(r.abs().max()))
    assert any(float(g.abs().max()) > 0 for g in grads[True][1])


def test_frozen_head_runs_once_per_chunk_under_grad() -> None:
    """The head's weight is read once per chunk in forward and never in backward (checkpointing
    ran it twice): counted by the matmuls that touch a [*, V] tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountHeadMatmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and VOCAB in tuple(out.shape) + \
                    tuple(args[0].shape):
                self.n += 1
            return out

    model = with_lora(llama())
    counter = CountHeadMatmuls()
    with counter:
        lp_BT, mask_BT = completion_logprobs(model, PROMPTS, COMPLETIONS, temperature=1.0, pad_id=PAD,
                                             head_chunk_tokens=4)
        (lp_BT * mask_BT).sum().backward()
    chunks = -(-sum(len(c) for c in COMPLETIONS) // 4)
    assert counter.n == 2 * chunks   # logits and d logp / d hidden, per chunk, both in forward
