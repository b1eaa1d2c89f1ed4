"""The validator's checks of multi-turn episodes: replay, and model-token-only log-prob rungs.

Legend: T = tokens of one episode trace, N = its model tokens.

Replay (the `episode` rung): for a deterministic environment, every environment reply of an
episode is recomputed from the model's turns (decoded from the trace's model spans, as the worker
decoded them) and re-encoded with the worker's rule (`node.tasks.episode_play.encode_observation`);
each environment token must equal the replay's. A worker that edits a reply (rewrites wordle's
feedback, invents a tool result) fails here, before any prefill. The log-prob and plausibility
rungs then look at model tokens only: environment tokens were never sampled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmrl.node.tasks.episode_play import encode_observation, safe_reply
from swarmrl.protocol.envs.base import PromptSpec
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec
from swarmrl.protocol.envs.trace import model_positions, split_turns
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import EPISODE
from swarmrl.validator.checks import CheckResult, fail, ok, undecided
from swarmrl.validator.plausibility import TokenStats


def replay_episode(env: EpisodeEnv, prompt: PromptSpec, tokenizer: Any, c: pb.Completion,
                   limits: EpisodeSpec) -> str:
    """"" when every environment reply of `c` equals the replay's, else what differs."""
    model, replies = split_turns(list(c.token_ids), list(c.token_mask))
    turns = [tokenizer.decode(ids, skip_special_tokens=True) for ids in model]
    if len(replies) not in (len(turns) - 1, len(turns)):
        return f"{len(turns)} model turns but {len(replies)} environment replies"
    for k, claimed in enumerate(replies):
        reply = safe_reply(env, prompt, turns[:k + 1])
        expected = encode_observation(tokenizer, reply.observation)[:limits.max_observation_tokens]
        if claimed != expected:
            shown = tokenizer.decode(claimed)[:40]
            return f"reply {k}: claimed {shown!r}, the environment answers {reply.observation[:40]!r}"
        if reply.done and k < len(turns) - 1:
            return f"reply {k}: the environment ended the episode there, the trace goes on"
    return ""


def check_replay(env: EpisodeEnv, prompt: PromptSpec, tokenizer: Any, group: pb.Group,
                 limits: EpisodeSpec) -> CheckResult:
    """The `episode` rung of one group (undecided for a non-deterministic environment)."""
    if not env.deterministic:
        return undecided(EPISODE, f"{env.name} is not deterministic: replies are not replayed")
    for i, c in enumerate(group.completions):
        problem = replay_episode(env, prompt, tokenizer, c, limits)
        if problem:
            return fail(EPISODE, f"completion {i} {problem}")
    return ok(EPISODE)


def model_only(values_T: Sequence[float], mask_T: Sequence[int]) -> list[float]:
    """The values at model positions (all of them for a single-turn completion's empty mask)."""
    keep = model_positions(mask_T, len(values_T))
    return [float(v) for v, k in zip(values_T, keep, strict=True) if k]


def model_stats(stats: TokenStats, token_ids_T: Sequence[int], mask_T: Sequence[int]) -> tuple[TokenStats, torch.Tensor]:
    """(the positions' `TokenStats`, their token ids) at model positions only."""
    keep = torch.tensor(model_positions(mask_T, len(token_ids_T)), dtype=torch.bool)
    ids = torch.tensor(list(token_ids_T), dtype=torch.long)
    return TokenStats(stats.psi_high_NL[keep], stats.psi_low_NL[keep], stats.argmax_N[keep]), ids[keep]
