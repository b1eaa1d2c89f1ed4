"""Any causal LM as the base model: a tiny random Qwen3 built here from a config (tokenizer trained
locally, with a ChatML chat template), found by folder path and pinned by sha256, then a learner
step, HF generation of chat-rendered prompts, and scoring that matches the sampler's log-probs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swarmrl.node.models.base_model import base_model_sha256, find_base_model, find_base_model_by_sha
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.models.recipes import build_tiny_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("qwen3-tiny")
    tok = build_tiny_tokenizer()
    tok.chat_template = CHATML
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.25, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_folder_is_found_and_pinned(qwen_dir: Path, tmp_path: Path) -> None:
    assert find_base_model(str(qwen_dir)) == qwen_dir
    sha = base_model_sha256(qwen_dir)
    assert find_base_model_by_sha("/elsewhere/on/the/submitter", sha, [str(qwen_dir)]) == qwen_dir
    with pytest.raises(ValueError, match="no local base model has the job's weights"):
        find_base_model_by_sha(str(qwen_dir), "0" * 64)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"lacks \*\.safetensors weights, tokenizer files"):
        find_base_model(str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        find_base_model("nobody/not-a-cached-model")


def test_qwen3_learner_step_generation_and_scoring(qwen_dir: Path) -> None:
    from swarmrl.node.inference import build_backend
    from swarmrl.node.inference.base import Sampling
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.protocol.envs.base import PromptSpec
    from swarmrl.protocol.pb import swarm_pb2 as pb
    from swarmrl.validator.rescoring import rescore

    spec = builtin_job(str(qwen_dir), group_size=4, learning_rate=1e-2, lora={"rank": 4, "alpha": 8},
                       sampling={"temperature": 1.0, "max_new_tokens": 6, "stop": []})
    assert spec.base_model_sha256 == base_model_sha256(qwen_dir)
    backend = build_backend("hf", qwen_dir)
    assert type(backend.model).__name__.startswith("Qwen3") or "Qwen3" in type(backend.model.get_base_model()).__name__
    prompt = PromptSpec(0, "What is 2+3?", {"answer": "5"}, messages=(("system", "Be brief."), ("user", "What is 2+3?")))
    ids = render_prompt(backend.tokenizer, prompt, chat_template=True)
    text = backend.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    learner = Learner(qwen_dir, spec)
    backend.add_slot("job", spec.lora)
    backend.set_adapter("job", learner.state())
    comps = backend.generate([ids], Sampling(n=4, max_new_tokens=6, seed=1), adapter="job")[0]
    scored = rescore(learner.model, [ids] * 4, [list(c.token_ids) for c in comps], temperature=1.0,
                     pad_id=backend.tokenizer.pad_token_id)
    for c, s in zip(comps, scored, strict=True):
        assert torch.allclose(torch.tensor(list(c.logprobs)), s.logprobs_T.float(), atol=1e-3)
    group = pb.Group(prompt_index=0, prompt_token_ids=ids)
    for i, c in enumerate(comps):
        group.completions.append(pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs, reward=float(i % 2),
                                               rewards=[float(i % 2)], finish_reason=c.finish_reason, policy_version=0))
    before = {k: v.clone() for k, v in learner.state().items()}
    metrics = learner.step([group], current_version=0)
    assert metrics["stepped"] == 1.0 and metrics["loss"] == metrics["loss"]
    assert any(not torch.equal(before[k], v) for k, v in learner.state().items())


def test_chat_job_on_a_tokenizer_without_template_is_refused(model_cache: Path) -> None:
    from transformers import AutoTokenizer

    from swarmrl.protocol.envs.base import PromptSpec

    tok = AutoTokenizer.from_pretrained(find_base_model("tiny", model_cache))
    with pytest.raises(ValueError, match="has none"):
        render_prompt(tok, PromptSpec(0, "hi"), chat_template=True)
