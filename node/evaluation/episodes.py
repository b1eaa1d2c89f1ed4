"""Multi-turn evaluation and display: `swarmrl eval` and `swarmrl env check` on episode environments.

`evaluate_episodes` plays one greedy episode per held-out prompt (the job's turn and token
limits, its per-turn sampling budget and stops) and reports the solve rate (`env.solved`), the
mean turns, the share of episodes that called a tool (environments with `tool_calls`, e.g.
calculator) and the mean total reward. `render_episode` prints one episode with the
environment's tokens marked, the tokens the loss never sees.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from swarmrl.node.evaluation.result import EvalResult
from swarmrl.node.inference.base import InferenceBackend, Sampling
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.episode_play import episode_rewards, play_episodes, scripted
from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec
from swarmrl.protocol.envs.trace import ENV, Trace, spans

BATCH = 16


@dataclass(frozen=True)
class EpisodeEval:
    """Held-out episode figures: solve rate, mean model turns, tool-call rate, mean reward."""

    solve_rate: float
    mean_turns: float
    tool_call_rate: float
    reward_mean: float
    n: int


def evaluate_episodes(backend: InferenceBackend, env: EpisodeEnv, prompts: Sequence[PromptSpec], adapter: str | None,
                      *, limits: EpisodeSpec, max_new_tokens: int, stop: tuple[str, ...],
                      chat_template: bool = False) -> EpisodeEval:
    """Greedy episodes (one per prompt, `BATCH` prompts per playing round) graded in-process."""
    sampling = Sampling(n=1, max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    traces: list[list[Trace]] = []
    for i in range(0, len(prompts), BATCH):
        chunk = list(prompts[i:i + BATCH])
        ids = [render_prompt(backend.tokenizer, p, chat_template) for p in chunk]
        traces += play_episodes(lambda c, s: backend.generate(c, s, adapter=adapter), backend.tokenizer, env, chunk,
                                ids, n=1, sampling=sampling, limits=limits)
    flat = [(p, g[0]) for p, g in zip(prompts, traces, strict=True)]
    totals = [env.total(r) or 0.0 for r in episode_rewards(env, prompts, traces, backend.tokenizer)]
    calls = getattr(env, "tool_calls", None)
    n = max(len(flat), 1)
    return EpisodeEval(
        solve_rate=sum(env.solved(p.info, t.turn_texts) for p, t in flat) / n,
        mean_turns=sum(t.turns for _, t in flat) / n,
        tool_call_rate=sum(bool(calls(t.turn_texts)) for _, t in flat) / n if calls else 0.0,
        reward_mean=sum(totals) / n, n=len(flat))


def render_episode(console: Console, tokenizer: Any, trace: Trace) -> None:
    """Print an episode token-exactly: model turns as they are, environment replies reversed and
    bracketed (they are context, masked out of the loss), then the counts."""
    text = Text()
    for m, lo, hi in spans(trace.mask_T):
        piece = tokenizer.decode(trace.token_ids_T[lo:hi])
        text.append(f"⟦{piece}⟧" if m == ENV else piece, style="reverse" if m == ENV else "bold")
    console.print(text)
    env_tokens = sum(1 for m in trace.mask_T if m == ENV)
    console.print(f"{trace.turns} model turns, {len(trace.mask_T) - env_tokens} model tokens (trained), "
                  f"{env_tokens} environment tokens ⟦masked⟧, finish {trace.finish_reason}; "
                  f"mask {''.join(str(m) for m in trace.mask_T)}", markup=False, highlight=False, soft_wrap=True)


def check_episode(console: Console, tokenizer: Any, env: EpisodeEnv, prompt: PromptSpec, prompt_ids: list[int],
                  limits: EpisodeSpec) -> None:
    """Play and print one episode of `prompt` with the environment's scripted player, graded."""
    traces = play_episodes(lambda c, s: [], tokenizer, env, [prompt], [prompt_ids], n=1,
                           sampling=Sampling(n=1, max_new_tokens=1), limits=limits, script=scripted(tokenizer, env))
    rewards = episode_rewards(env, [prompt], traces, tokenizer)[0]
    console.rule(f"episode of prompt {prompt.index} (scripted player)")
    console.print(f"reward {env.total(rewards)} = {list(rewards)} x {list(env.reward_weights)}; "
                  f"solved {env.solved(prompt.info, traces[0][0].turn_texts)}", markup=False, highlight=False,
                  soft_wrap=True)
    render_episode(console, tokenizer, traces[0][0])


def score_episodes(backend: InferenceBackend, env: EpisodeEnv, spec: Any, prompts: Sequence[PromptSpec],
                   adapter: str) -> tuple[EpisodeEval, EpisodeEval]:
    """(base, adapter slot `adapter`) greedy episodes of job `spec` on `prompts`, with the job's
    turn and token limits, per-turn budget, stops and chat template."""
    from swarmrl.protocol.episode_limits import episode_limits

    limits = episode_limits(spec, env)
    assert limits is not None
    kw = {"limits": limits, "max_new_tokens": spec.sampling.max_new_tokens, "stop": tuple(spec.sampling.stop),
          "chat_template": spec.chat_template}
    return (evaluate_episodes(backend, env, prompts, None, **kw),
            evaluate_episodes(backend, env, prompts, adapter, **kw))


def run_episode_eval(backend: InferenceBackend, env: EpisodeEnv, spec: Any, prompts: Sequence[PromptSpec],
                     adapter_dir: Path, adapter: str, model_name: str) -> tuple[Any, Any]:
    """`swarmrl eval` on a multi-turn job: base vs adapter greedy episodes on the held-out
    prompts; prints the table and one JSON line; the solve rates go into the model card."""
    from swarmrl.node.models.card import add_heldout

    base, tuned = score_episodes(backend, env, spec, prompts, adapter)
    table = Table(title=f"held-out {env.name} episodes, greedy, n={len(prompts)} ({model_name})")
    for col in ("model", "solve rate", "mean turns", "tool-call rate", "mean reward"):
        table.add_column(col)
    for label, r in (("base", base), (f"base + adapter ({adapter_dir})", tuned)):
        table.add_row(label, f"{r.solve_rate:.3f}", f"{r.mean_turns:.2f}", f"{r.tool_call_rate:.3f}", f"{r.reward_mean:.3f}")
    Console().print(table)
    print(json.dumps({"base_solve_rate": base.solve_rate, "adapter_solve_rate": tuned.solve_rate,
                      "base_mean_turns": base.mean_turns, "adapter_mean_turns": tuned.mean_turns,
                      "base_tool_call_rate": base.tool_call_rate, "adapter_tool_call_rate": tuned.tool_call_rate,
                      "base_reward": base.reward_mean, "adapter_reward": tuned.reward_mean, "n": len(prompts)}))
    add_heldout(adapter_dir, base.solve_rate, tuned.solve_rate, len(prompts))
    return (EvalResult(base.solve_rate, base.reward_mean, base.n), EvalResult(tuned.solve_rate, tuned.reward_mean, tuned.n))
