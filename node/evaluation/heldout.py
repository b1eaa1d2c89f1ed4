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

from swarmrl.node.evaluation.result import EvalResult
from swarmrl.node.inference import build_backend
from swarmrl.node.inference.base import InferenceBackend, Sampling
from swarmrl.node.models.base_model import find_base_model, is_builtin_model, resolve_model_name
from swarmrl.node.models.card import add_heldout
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.protocol.envs import get_environment, heldout_prompts, job_environment
from swarmrl.protocol.envs.base import Environment, PromptSpec
from swarmrl.protocol.envs.dataset import DatasetEnv
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.jobspec import JobSpec

EVAL_ADAPTER = "heldout-eval"
BATCH = 16


def load_adapter(backend: InferenceBackend, slot: str, adapter_dir: Path) -> None:
    """Load the PEFT adapter folder `adapter_dir` (adapter_config.json, adapter_model.safetensors)
    into `backend`'s slot `slot`, its weights as float32. Raises what peft and safetensors raise
    for a missing or malformed folder (OSError, ValueError)."""
    import peft

    backend.add_slot(slot, peft.LoraConfig.from_pretrained(str(adapter_dir)))
    backend.set_adapter(slot, {k: v.float() for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()})


def evaluate(backend: InferenceBackend, env: Environment, prompts: list[PromptSpec], adapter: str | None,
             max_new_tokens: int, stop: tuple[str, ...] | None = None, chat_template: bool = False) -> EvalResult:
    """Greedy completions for `prompts` (rendered as workers render them), graded in-process
    with the environment's functions; accuracy is the share whose first reward is 1."""
    sampling = Sampling(n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                        stop=tuple(env.stop) if stop is None else stop)
    texts: list[str] = []
    for i in range(0, len(prompts), BATCH):
        chunk = prompts[i:i + BATCH]
        ids = [render_prompt(backend.tokenizer, p, chat_template) for p in chunk]
        texts += [c[0].text for c in backend.generate(ids, sampling, adapter=adapter)]
    rewards = env.rewards(prompts, texts)  # [prompt][reward function]
    correct = [r[0] == 1.0 for r in rewards]
    totals = [env.total(r) or 0.0 for r in rewards]
    return EvalResult(sum(correct) / len(correct), sum(totals) / len(totals), len(correct))


@dataclass(frozen=True)
class EvalPlan:
    """One held-out evaluation: the backend (adapter loaded in slot EVAL_ADAPTER), the task, its
    held-out prompts and how to sample them; `spec` is the job's (None: the default task)."""

    backend: InferenceBackend
    env: Environment
    prompts: list[PromptSpec]
    max_new_tokens: int
    stop: tuple[str, ...] | None
    chat: bool
    title: str
    spec: JobSpec | None = None


def backend_with_adapter(model: str, adapter_dir: Path, cache_dir: Path | None = None) -> InferenceBackend:
    """An hf backend on base `model` (a built-in name, a folder or a cached hub id) with the
    adapter of `adapter_dir` in slot EVAL_ADAPTER."""
    name = resolve_model_name(model) if is_builtin_model(model) else model
    backend = build_backend("hf", find_base_model(name, cache_dir))
    load_adapter(backend, EVAL_ADAPTER, adapter_dir)
    return backend


def job_plan(backend: InferenceBackend, spec: JobSpec, env: Environment, n: int) -> EvalPlan:
    """The plan for job `spec` on its environment `env`: `n` held-out prompts of the job's seed
    (a data set: at most as many as rows held out), sampled with the job's length, stops and chat template."""
    n = min(n, len(env.heldout_rows)) if isinstance(env, DatasetEnv) else n
    return EvalPlan(backend, env, heldout_prompts(env, n, spec.seed), spec.sampling.max_new_tokens,
                    tuple(spec.sampling.stop), spec.chat_template, spec.environment_id, spec)


def score(plan: EvalPlan) -> tuple[EvalResult, EvalResult]:
    """(base, adapter) greedy scores of `plan`; an episode task scores its solve rate."""
    if isinstance(plan.env, EpisodeEnv):
        from swarmrl.node.evaluation.episodes import score_episodes

        base_e, tuned_e = score_episodes(plan.backend, plan.env, plan.spec, plan.prompts, EVAL_ADAPTER)
        return (EvalResult(base_e.solve_rate, base_e.reward_mean, base_e.n),
                EvalResult(tuned_e.solve_rate, tuned_e.reward_mean, tuned_e.n))
    base = evaluate(plan.backend, plan.env, plan.prompts, None, plan.max_new_tokens, plan.stop, plan.chat)
    tuned = evaluate(plan.backend, plan.env, plan.prompts, EVAL_ADAPTER, plan.max_new_tokens, plan.stop, plan.chat)
    return base, tuned


def heldout_of_job(adapter_dir: Path, spec: JobSpec, dataset: bytes | None = None, *, n: int = 200,
                   cache_dir: Path | None = None) -> tuple[EvalResult, EvalResult]:
    """`swarmrl up`'s headline figure: base vs the adapter in `adapter_dir` on `n` held-out
    prompts of job `spec` (greedy), recorded in the adapter's model card; nothing printed."""
    backend = backend_with_adapter(spec.base_model, adapter_dir, cache_dir)
    base, tuned = score(job_plan(backend, spec, job_environment(spec, dataset), n))
    add_heldout(adapter_dir, base.accuracy, tuned.accuracy, tuned.n)
    return base, tuned


def run_eval(adapter_dir: Path, *, model: str | None = None, n: int = 200, cache_dir: Path | None = None,
             seed: int | None = None, max_new_tokens: int = 8, job_file: Path | None = None) -> tuple[EvalResult, EvalResult]:
    """Print (and return) base vs adapter scores on `n` held-out prompts of the job file's task
    (default: the built-in arithmetic task); a data set has as many held-out prompts as rows held out.
    `seed` is the job's seed (default: the job file's, else 0): a data-set job's held-out rows
    are a seed hash split, so score an adapter with the seed it was trained with."""
    import peft

    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    name = model or config.base_model_name_or_path
    name = resolve_model_name(name) if is_builtin_model(name) else name
    backend = backend_with_adapter(name, adapter_dir, cache_dir)
    if job_file is not None:
        from swarmrl.node.tasks.job_file import load_job_file

        loaded = load_job_file(job_file, cache_dir, None if seed is None else {"seed": seed}, base_model=name,
                               tokenizer=backend.tokenizer)
        plan = job_plan(backend, loaded.spec, job_environment(loaded.spec, loaded.dataset), n)
    else:
        env = get_environment("arithmetic", "1")
        plan = EvalPlan(backend, env, heldout_prompts(env, n, seed or 0), max_new_tokens, None, False, "arithmetic")
    if isinstance(plan.env, EpisodeEnv):   # multi-turn: solve rate, mean turns, tool calls (node/evaluation/episodes.py)
        from swarmrl.node.evaluation.episodes import run_episode_eval

        return run_episode_eval(backend, plan.env, plan.spec, plan.prompts, adapter_dir, EVAL_ADAPTER, name)
    base, tuned = score(plan)
    n = len(plan.prompts)
    table = Table(title=f"held-out {plan.title}, greedy, n={n} ({name})")
    for col in ("model", "accuracy", "mean reward"):
        table.add_column(col)
    table.add_row("base", f"{base.accuracy:.3f}", f"{base.reward_mean:.3f}")
    table.add_row(f"base + adapter ({adapter_dir})", f"{tuned.accuracy:.3f}", f"{tuned.reward_mean:.3f}")
    Console().print(table)
    print(json.dumps({"base_accuracy": base.accuracy, "adapter_accuracy": tuned.accuracy,
                      "base_reward": base.reward_mean, "adapter_reward": tuned.reward_mean, "n": n}))
    add_heldout(adapter_dir, base.accuracy, tuned.accuracy, n)   # into the adapter's model card
    return base, tuned
