"""HFBackend on the tiny random Llama of `models.prepare_base_model("tiny")`: sampling, log-probs,
stops, seeds and adapter slots.

Legend: B = prompts, n = completions per prompt, T = completion tokens.
"""

from __future__ import annotations

import math

import peft
import pytest
import torch

from swarmrl.node.inference import Sampling, build_backend
from swarmrl.node.inference.hf import HFBackend, _draw, ensure_contiguous_head_input
from swarmrl.node.inference.scoring import completion_logprobs, token_logprobs
from swarmrl.node.inference.stops import first_stop
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm, lora_config
from swarmrl.protocol.jobspec import LoraSpec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

PROMPTS = ["Question: What is 3+4?\nAnswer:", "What is 12+7?", "1+1="]


def random_state(backend: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    """A state with the slot's keys/shapes and random (non-zero) A and B."""
    gen = torch.Generator().manual_seed(seed)
    template = peft.get_peft_model_state_dict(backend.model, adapter_name="swarmrl-placeholder")
    return {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in template.items()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return prepare_base_model("tiny", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def backend(model_dir) -> HFBackend:
    model, tokenizer = load_causal_lm(model_dir, num_threads=1)
    b = HFBackend(model, tokenizer, lora_config(rank=4, alpha=8, target_modules=TARGETS))
    b.set_adapter("job-a", random_state(b, 1))
    b.set_adapter("job-b", random_state(b, 2))
    return b


def encode(backend: HFBackend) -> list[list[int]]:
    return [encode_prompt(backend.tokenizer, p) for p in PROMPTS]


def test_shapes_logprobs_and_text(backend: HFBackend) -> None:
    out = backend.generate(encode(backend), Sampling(n=4, max_new_tokens=12, seed=1), adapter="job-a")
    assert len(out) == len(PROMPTS) and all(len(group) == 4 for group in out)
    for c in (c for group in out for c in group):
        assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(x) and x <= 0.0 for x in c.logprobs)
        assert all(0 <= t < backend.vocab_size for t in c.token_ids)
        assert c.text == backend.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize(("adapter", "temperature", "top_p"), [(None, 1.0, 1.0), ("job-a", 0.7, 1.0), ("job-b", 1.3, 0.9)])
def test_sampling_logprobs_match_scoring(backend: HFBackend, adapter: str | None, temperature: float, top_p: float) -> None:
    """The sampler-vs-trainer agreement: scoring the sampled tokens reproduces their log-probs."""
    prompts = encode(backend)
    sampling = Sampling(n=3, max_new_tokens=10, temperature=temperature, top_p=top_p, seed=7)
    out = backend.generate(prompts, sampling, adapter=adapter)
    flat = [(p, c) for p, group in zip(prompts, out, strict=True) for c in group]
    with backend.activated(adapter) as model, torch.no_grad():
        logprobs_BT, mask_BT = completion_logprobs(
            model, [p for p, _ in flat], [c.token_ids for _, c in flat],
            temperature=temperature, pad_id=backend.pad_token_id,
        )
    for b, (_, c) in enumerate(flat):
        assert mask_BT[b].sum().item() == len(c.token_ids)
        sampled = torch.tensor(c.logprobs)
        # fp32, KV-cached decode against one prefill: summation order differs (max 1.1e-5 measured on
        # the tiny model's 32-wide heads)
        assert torch.allclose(logprobs_BT[b, : len(c.token_ids)], sampled, rtol=0.0, atol=5e-5)


def test_eos_kept_and_finish_reasons(backend: HFBackend) -> None:
    """The near-uniform random model samples EOS now and then: it ends the completion."""
    eos = backend.tokenizer.eos_token_id
    out = backend.generate(encode(backend), Sampling(n=12, max_new_tokens=40, seed=3), adapter="job-a")
    completions = [c for group in out for c in group]
    ended = [c for c in completions if c.finish_reason == "stop"]
    assert ended and len(ended) < len(completions)
    for c in completions:
        assert eos not in c.token_ids[:-1]
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and len(c.token_ids) <= 40
        else:
            assert len(c.token_ids) == 40


def test_stop_strings_truncate_after_completing_token(backend: HFBackend) -> None:
    stops = ("+", "\n")
    out = backend.generate(encode(backend), Sampling(n=8, max_new_tokens=30, stop=stops, seed=5))
    decode = lambda ids: backend.tokenizer.decode(ids, skip_special_tokens=True)
    by_stop = 0
    for c in (c for group in out for c in group):
        has_stop = any(s in c.text for s in stops)
        if c.finish_reason == "length":
            assert not has_stop and len(c.token_ids) == 30
        elif c.token_ids[-1] != backend.tokenizer.eos_token_id:
            by_stop += 1
            assert has_stop and not any(s in decode(c.token_ids[:-1]) for s in stops)
    assert by_stop > 0


def test_first_stop_spanning_tokens(backend: HFBackend) -> None:
    tok = backend.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in ["a", "1", "2", "b", "1", "2"]]
    assert first_stop(tok, ids, ("12",)) == 2
    assert first_stop(tok, ids, ("b1", "x")) == 4
    assert first_stop(tok, ids, ("zz",)) is None


def test_greedy_is_deterministic(backend: HFBackend) -> None:
    prompts = encode(backend)
    sampling = Sampling(n=3, max_new_tokens=8, temperature=0.0)
    first = backend.generate(prompts, sampling, adapter="job-b")
    second = backend.generate(prompts, sampling, adapter="job-b")
    assert first == second
    for group in first:
        assert all(c == group[0] for c in group)


def test_seed_reproduces_and_differs(backend: HFBackend) -> None:
    prompts = encode(backend)
    one = backend.generate(prompts, Sampling(n=4, max_new_tokens=8, seed=11), adapter="job-a")
    again = backend.generate(prompts, Sampling(n=4, max_new_tokens=8, seed=11), adapter="job-a")
    other = backend.generate(prompts, Sampling(n=4, max_new_tokens=8, seed=12), adapter="job-a")
    assert one == again and one != other
    assert len({tuple(c.token_ids) for c in one[0]}) > 1  # rows of a group are different samples


def test_slots_and_base_differ(backend: HFBackend) -> None:
    prompts = encode(backend)
    greedy = Sampling(n=1, max_new_tokens=8, temperature=0.0)
    outs = {a: backend.generate(prompts, greedy, adapter=a) for a in (None, "job-a", "job-b")}
    assert outs[None] != outs["job-a"] and outs[None] != outs["job-b"] and outs["job-a"] != outs["job-b"]
    with backend.activated(None) as model, torch.no_grad():
        ref = model.get_base_model()(torch.tensor([prompts[0]])).logits[0, -1]
    first = outs[None][0][0]
    assert first.token_ids[0] == int(ref.argmax())
    assert abs(first.logprobs[0] - token_logprobs(ref[None], torch.tensor([first.token_ids[0]]), 1.0).item()) < 1e-5


def test_set_adapter_is_bit_exact(backend: HFBackend) -> None:
    state = random_state(backend, 3)
    backend.set_adapter("exact", state)
    got = peft.get_peft_model_state_dict(backend.model, adapter_name="exact")
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    replaced = {k: v + 1.0 for k, v in state.items()}
    backend.set_adapter("exact", replaced)
    assert all(torch.equal(v, replaced[k]) for k, v in backend.adapter_state("exact").items())
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}  # bf16 fits the fp32 slot exactly
    backend.set_adapter("exact", as_bf16)
    assert all(torch.equal(v, as_bf16[k].float()) for k, v in backend.adapter_state("exact").items())
    backend.remove_adapter("exact")
    assert "exact" not in backend.adapters
    with pytest.raises(KeyError):
        backend.generate(encode(backend), Sampling(n=1, max_new_tokens=2), adapter="exact")
    with pytest.raises(KeyError):
        backend.remove_adapter("exact")


def test_set_adapter_rejects_bad_states(backend: HFBackend) -> None:
    state = random_state(backend, 4)
    key = next(iter(state))
    bad_states = [
        {k: v for k, v in state.items() if k != key},
        {**state, "base_model.model.extra.lora_A.weight": torch.zeros(1)},
        {**state, key: torch.zeros(1, 1)},
        {**state, key: torch.full_like(state[key], float("nan"))},
        {**state, key: state[key].double() + 1e-12},  # float64 that fp32 can't hold
    ]
    for bad in bad_states:
        with pytest.raises(ValueError):
            backend.set_adapter("bad", bad)
        assert "bad" not in backend.adapters
    with pytest.raises(ValueError):
        backend.set_adapter("swarmrl-placeholder", state)


def test_rejects_bad_prompts(backend: HFBackend) -> None:
    with pytest.raises(ValueError):
        backend.generate([[]], Sampling(n=1, max_new_tokens=2))
    with pytest.raises(ValueError):
        backend.generate([[5, backend.vocab_size]], Sampling(n=1, max_new_tokens=2))
    with pytest.raises(ValueError):
        Sampling(n=0, max_new_tokens=2)
    assert backend.generate([], Sampling(n=2, max_new_tokens=2)) == []


def test_head_hook_installed_once(backend: HFBackend) -> None:
    head = backend.model.get_base_model().get_output_embeddings()
    before = len(head._forward_pre_hooks)
    ensure_contiguous_head_input(backend.model.get_base_model())
    assert before >= 1 and len(head._forward_pre_hooks) == before


def test_draw_follows_the_distribution_and_nucleus() -> None:
    gen = torch.Generator().manual_seed(0)
    probs_RV = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]).expand(40_000, 5)
    freq = torch.bincount(_draw(probs_RV, 1.0, gen), minlength=5) / 40_000
    assert torch.allclose(freq, probs_RV[0], atol=0.01) and freq[4] == 0
    freq = torch.bincount(_draw(probs_RV, 0.7, gen), minlength=5) / 40_000  # nucleus {0, 1}
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0, 0.0]), atol=0.01)
    weights_V = torch.arange(5000, 0, -1, dtype=torch.float32)  # nucleus wider than the first top-k
    probs_RV = (weights_V / weights_V.sum()).expand(2000, 5000)
    ids = _draw(probs_RV, 0.5, gen)
    mass_before = torch.cumsum(probs_RV[0], 0) - probs_RV[0]
    assert ids.max() < int((mass_before < 0.5).sum()) and ids.max() > 1024


def test_add_slot_from_job_spec_and_build_backend(model_dir) -> None:
    backend = build_backend("hf", model_dir, num_threads=1)
    assert isinstance(backend, HFBackend)
    prompts = encode(backend)
    greedy = Sampling(n=1, max_new_tokens=6, temperature=0.0)
    backend.add_slot("job", LoraSpec(rank=8, alpha=16))
    backend.add_slot("job", LoraSpec(rank=8, alpha=16))  # same shape: no-op
    assert backend.adapters == {"job"}
    assert backend.generate(prompts, greedy, adapter="job") == backend.generate(prompts, greedy)  # B = 0
    with pytest.raises(ValueError):
        backend.add_slot("job", LoraSpec(rank=4, alpha=16))
    state = peft.get_peft_model_state_dict(backend.model, adapter_name="job")
    assert all(v.shape[0] == 8 or v.shape[1] == 8 for v in state.values())
    gen = torch.Generator().manual_seed(9)
    new = {k: 0.2 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    backend.set_adapter("job", new)
    assert all(torch.equal(v, new[k]) for k, v in backend.adapter_state("job").items())
    assert backend.generate(prompts, greedy, adapter="job") != backend.generate(prompts, greedy)
    backend.add_slot("narrow", LoraSpec(rank=2, alpha=4, target_modules=("q_proj", "v_proj")))
    assert len(peft.get_peft_model_state_dict(backend.model, adapter_name="narrow")) == 2 * 2 * 2
    with pytest.raises(ValueError):
        build_backend("nope", model_dir)
