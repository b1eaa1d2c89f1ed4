"""`swarmrl eval`: held-out greedy accuracy of the base model and of an adapter, side by side.

Held-out prompts come from the environment's held-out index range, which training never leases.
Both arms use the same backend, prompts and greedy decoding; only the adapter differs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file

from swarmrl.node.inference import build_backend
from swarmrl.node.inference.base import InferenceBackend, Sampling
from swarmrl.node.model_card import add_heldout
from swarmrl.node.models import encode_prompt, prepare_base_model, resolve_model_name
from swarmrl.protocol.envs import get_environment, heldout_prompts
from swarmrl.protocol.envs.base import Environment, PromptSpec
from swarmrl.protocol.jobspec import LoraSpec

EVAL_ADAPTER = "heldout-eval"
BATCH = 16


@dataclass(frozen=True)
class EvalResult:
    """Accuracy (share of completions whose correctness reward is 1) and mean total reward."""

    accuracy: float
    reward_mean: float
    n: int


def evaluate(backend: InferenceBackend, env: Environment, prompts: list[PromptSpec], adapter: str | None,
             max_new_tokens: int) -> EvalResult:
    """Greedy completions for `prompts`, graded in-process with the environment's functions."""
    sampling = Sampling(n=1, max_new_tokens=max_new_tokens, temperature=0.0, stop=tuple(env.stop))
    texts: list[str] = []
    for i in range(0, len(prompts), BATCH):
        chunk = prompts[i:i + BATCH]
        ids = [encode_prompt(backend.tokenizer, p.text) for p in chunk]
        texts += [c[0].text for c in backend.generate(ids, sampling, adapter=adapter)]
    rewards = env.rewards(prompts, texts)  # [prompt][reward function]
    correct = [r[0] == 1.0 for r in rewards]
    totals = [env.total(r) or 0.0 for r in rewards]
    return EvalResult(sum(correct) / len(correct), sum(totals) / len(totals), len(correct))


def run_eval(adapter_dir: Path, *, model: str | None = None, n: int = 200, cache_dir: Path | None = None,
             seed: int = 0, max_new_tokens: int = 8) -> tuple[EvalResult, EvalResult]:
    """Print (and return) base vs adapter accuracy on `n` held-out arithmetic prompts."""
    import peft

    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    name = resolve_model_name(model or config.base_model_name_or_path)
    backend = build_backend("hf", prepare_base_model(name, cache_dir))
    state = {k: v.float() for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    targets = config.target_modules
    backend.add_slot(EVAL_ADAPTER, LoraSpec(
        rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets or ())),
    ))
    backend.set_adapter(EVAL_ADAPTER, state)
    env = get_environment("arithmetic", "1")
    prompts = heldout_prompts(env, n, seed)
    base = evaluate(backend, env, prompts, None, max_new_tokens)
    tuned = evaluate(backend, env, prompts, EVAL_ADAPTER, max_new_tokens)
    table = Table(title=f"held-out arithmetic, greedy, n={n} ({name})")
    for col in ("model", "accuracy", "mean reward"):
        table.add_column(col)
    table.add_row("base", f"{base.accuracy:.3f}", f"{base.reward_mean:.3f}")
    table.add_row(f"base + adapter ({adapter_dir})", f"{tuned.accuracy:.3f}", f"{tuned.reward_mean:.3f}")
    Console().print(table)
    print(json.dumps({"base_accuracy": base.accuracy, "adapter_accuracy": tuned.accuracy, "n": n}))
    add_heldout(adapter_dir, base.accuracy, tuned.accuracy, n)   # into the adapter's model card
    return base, tuned
