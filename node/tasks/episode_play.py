"""Playing multi-turn episodes with a sampler, and the grading rows of any group.

Legend: P = prompts (first observations), G = episodes per prompt, T = trace tokens.

`play_episodes` advances every unfinished episode by one model turn per `generate` call (one
batched call per turn, so a group's G episodes and a lease's prompts share the sampler), asks
the environment for its reply, and appends the reply's tokens (`encode_observation`, the one
rule the worker and the validator's replay share) to the trace. An episode ends when the
environment says so (finish "stop"), or at the job's turn or token limit (finish "length").
A reply that raises or overruns `reply_timeout_s` ends the episode with the error as its last
observation; the player goes on with the other episodes.

Used by the worker (`node.worker.episodes`), `swarmrl eval`, `swarmrl env check` and
benchmarks/episode_cost.py; `grade_rows` also by the validator's re-grade.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarmrl.node.inference.base import SampledCompletion, Sampling
from swarmrl.node.models.causal_lm import encode_text
from swarmrl.protocol.envs.base import Environment, PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec, Reply
from swarmrl.protocol.envs.trace import Trace, model_spans
from swarmrl.protocol.pb import swarm_pb2 as pb

Generate = Callable[[list[list[int]], Sampling], list[list[SampledCompletion]]]
Script = Callable[[PromptSpec, list[str]], SampledCompletion]   # (prompt, turns so far) -> next turn
REPLY_TIMEOUT_S = 5.0


def encode_observation(tokenizer: Any, text: str) -> list[int]:
    """An environment reply's (or a scripted turn's) token ids: the text tokenized alone, no
    special token added and none read from it (`encode_text`: a reply that spells
    `<end_of_turn>` is those characters, not the control token)."""
    return encode_text(tokenizer, text)


def safe_reply(env: EpisodeEnv, spec: PromptSpec, turns: Sequence[str], timeout_s: float = REPLY_TIMEOUT_S) -> Reply:
    """`env.reply(spec, turns)`, or the end of the episode with the error as its observation when
    the environment raises or takes longer than `timeout_s` (its thread is left to finish)."""
    box: list[Reply | BaseException] = []

    def run() -> None:
        try:
            box.append(env.reply(spec, list(turns)))
        except Exception as exc:  # noqa: BLE001 - environment code: any failure ends the episode
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True, name="env-reply")
    thread.start()
    thread.join(timeout_s)
    if not box:
        return Reply(f"\n[environment error: no reply within {timeout_s:g}s]", done=True, error=True)
    out = box[0]
    if isinstance(out, BaseException):
        return Reply(f"\n[environment error: {type(out).__name__}: {str(out)[:120]}]", done=True, error=True)
    return out


@dataclass
class _Episode:
    prompt: int
    spec: PromptSpec
    trace: Trace


def play_episodes(generate: Generate, tokenizer: Any, env: EpisodeEnv, specs: Sequence[PromptSpec],
                  prompt_ids: Sequence[Sequence[int]], *, n: int, sampling: Sampling, limits: EpisodeSpec,
                  reply_timeout_s: float = REPLY_TIMEOUT_S, script: Script | None = None) -> list[list[Trace]]:
    """`n` episodes of each prompt; result indexed [prompt][episode].

    sampling: one model turn's parameters (`n` is ignored: each call samples one turn per
    unfinished episode; the seed, if set, advances by one per turn).
    script: play these turns instead of sampling (`scripted`); `generate` is then not called.
    """
    episodes = [_Episode(p, spec, Trace()) for p, spec in enumerate(specs) for _ in range(n)]
    active = list(episodes)
    turn = 0
    while active:
        contexts = [list(prompt_ids[e.prompt]) + e.trace.token_ids_T for e in active]
        seed = None if sampling.seed is None else sampling.seed + turn
        turn_sampling = Sampling(n=1, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                 top_p=sampling.top_p, stop=sampling.stop, seed=seed)
        outs = ([[script(e.spec, list(e.trace.turn_texts))] for e in active] if script is not None
                else generate(contexts, turn_sampling))
        active = [e for e, out in zip(active, outs, strict=True)
                  if _advance(e, out[0], env, tokenizer, limits, reply_timeout_s)]
        turn += 1
    return [[e.trace for e in episodes[p * n:(p + 1) * n]] for p in range(len(specs))]


def _advance(e: _Episode, out: SampledCompletion, env: EpisodeEnv, tokenizer: Any, limits: EpisodeSpec,
             reply_timeout_s: float) -> bool:
    """Append one model turn and the environment's reply; False when the episode ended."""
    trace = e.trace
    room = limits.max_tokens - len(trace.token_ids_T)
    ids, lps = out.token_ids[:room], out.logprobs[:room]
    text = out.text if len(ids) == len(out.token_ids) else tokenizer.decode(ids, skip_special_tokens=True)
    trace.add_model(ids, lps, text)
    if len(ids) < len(out.token_ids) or not ids:
        trace.finish_reason = "length"
        return False
    reply = safe_reply(env, e.spec, trace.turn_texts, reply_timeout_s)
    obs = encode_observation(tokenizer, reply.observation)[:limits.max_observation_tokens]
    if reply.done and not reply.error:
        trace.finish_reason = "stop"
        return False
    if reply.error or not obs:   # an error ends the episode with its text; an empty reply ends it silently
        if obs and len(trace.token_ids_T) + len(obs) <= limits.max_tokens:
            trace.add_env(obs, reply.observation)
        trace.finish_reason = "stop"
        return False
    if trace.turns >= limits.max_turns or len(trace.token_ids_T) + len(obs) >= limits.max_tokens:
        trace.finish_reason = "length"
        return False
    trace.add_env(obs, tokenizer.decode(obs))
    return True


def scripted(tokenizer: Any, env: EpisodeEnv) -> Script:
    """The environment's reference player (`env.scripted_turn`) as a `Script`: each turn's text
    tokenized alone, its log-probs 0.0."""
    def turn(spec: PromptSpec, turns: list[str]) -> SampledCompletion:
        text = env.scripted_turn(spec, turns)
        ids = encode_observation(tokenizer, text)
        return SampledCompletion(ids, [0.0] * len(ids), "stop", text)
    return turn


def episode_rewards(env: EpisodeEnv, specs: Sequence[PromptSpec], traces: Sequence[Sequence[Trace]],
                    tokenizer: Any) -> list[list[float | None]]:
    """Grade played episodes in-process (`swarmrl eval`, `env check`): rows `rewards_F`, one per
    episode in [prompt][episode] order, with the columns workers pass (`turns`, `group`)."""
    rows, texts = [], []
    for spec, group in zip(specs, traces, strict=True):
        for t in group:
            info = {**spec.info, "turns": list(t.turn_texts)}
            if env.group_rewards:
                info["group"] = spec.index
            rows.append(PromptSpec(index=spec.index, text=spec.text, info=info))
            texts.append(tokenizer.decode(t.token_ids_T, skip_special_tokens=True))
    return env.rewards(rows, texts)


def trace_completion(trace: Trace, policy_version: int, adapter_hash: bytes = b"") -> pb.Completion:
    """The wire form of one episode (ungraded), sampled with adapter `policy_version` (`adapter_hash`)."""
    return pb.Completion(token_ids=trace.token_ids_T, logprobs=trace.logprobs_T, finish_reason=trace.finish_reason,
                         policy_version=policy_version, adapter_hash=adapter_hash, token_mask=trace.mask_T,
                         turns=trace.turns)


def turn_texts(tokenizer: Any, c: pb.Completion) -> list[str]:
    """The model's turns of a completion as text (decoded from its model spans; no re-encoding)."""
    ids = list(c.token_ids)
    return [tokenizer.decode(ids[lo:hi], skip_special_tokens=True) for lo, hi in model_spans(list(c.token_mask))]


def grade_rows(tokenizer: Any, env: Environment, prompt: PromptSpec, group: pb.Group) -> tuple[list[str], list[dict[str, Any]]]:
    """(completion texts, info rows) to grade a group's completions with: the decoded text, the
    prompt's info, and for multi-turn environments `turns` (the model's turn texts), and for
    environments with group-level rewards `group` (the prompt index)."""
    texts, infos = [], []
    for c in group.completions:
        texts.append(tokenizer.decode(list(c.token_ids), skip_special_tokens=True))
        info = dict(prompt.info)
        if isinstance(env, EpisodeEnv):
            info["turns"] = turn_texts(tokenizer, c)
        if env.group_rewards:
            info["group"] = int(group.prompt_index)
        infos.append(info)
    return texts, infos
