"""Multi-turn environments: the model acts, the environment answers, and the episode is graded.

An `EpisodeEnv` is an `Environment` whose prompt is the episode's first observation. After each
model turn, `reply(spec, turns)` gives the environment's answer to the turns so far: the next
observation (text the model reads before its next turn) or the end of the episode. `reply` is a
pure function of the prompt and the model's turns (`deterministic`), so a validator replays any
episode from its model turns alone and compares every environment token.

Grading is TRL-style, as for single-turn environments: reward functions
`f(prompts, completions, **columns)`, where `completions` holds each episode's text after the
first observation and the columns carry the prompt's `info` plus `turns` (the model's turn texts
of each episode) and `group` (an id shared by the episodes of one group; group-level rewards
compare the episodes that share it, `protocol.envs.group_rewards`).

The job's limits (`EpisodeSpec`, the job's `episode` setting): turns per episode and tokens
after the first observation (model and environment tokens together); admission enforces both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from swarmrl.protocol.envs.base import Environment, PromptSpec


class EpisodeSpec(BaseModel):
    """Per-episode limits of a multi-turn job (the `episode` table of a job TOML).

    max_turns: model turns per episode at most.
    max_tokens: tokens after the first observation at most (model and environment tokens).
    max_observation_tokens: tokens of one environment reply at most (longer ones are cut).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_turns: int = Field(6, ge=1, le=64)
    max_tokens: int = Field(256, ge=2, le=16384)
    max_observation_tokens: int = Field(48, ge=1, le=4096)


@dataclass(frozen=True)
class Reply:
    """The environment's answer to the model's turns so far.

    observation: text appended after the model's last turn (ignored when the episode ends,
        unless `error` is set: the error's text then closes the trace).
    done: the episode is over (solved, failed, or the environment gave up).
    error: set (done) when the environment's code raised or overran: the player ends the
        episode with `observation` (the error) as its last environment tokens.
    """

    observation: str
    done: bool
    error: bool = False


class EpisodeEnv(Environment):
    """An environment whose episodes have several turns (see the module docstring).

    Class attributes beyond `Environment`'s: `deterministic` (replies are a pure function of the
    prompt and the model's turns: validators replay them), `max_turns` (the environment's own
    cap; the job's `episode.max_turns` applies too).
    """

    deterministic: bool = True
    max_turns: int = 6

    def first_observation(self, seed: int, index: int) -> PromptSpec:
        """The episode's first observation: `prompt(seed, index)`."""
        return self.prompt(seed, index)

    def reply(self, spec: PromptSpec, turns: Sequence[str]) -> Reply:
        """The answer to the model's `turns` (the last is the new one); `len(turns) >= 1`.

        Must be a pure function of (spec, turns) when `deterministic`. Raises whatever the
        environment's code raises: players (`node.tasks.episode_play`) end the episode with the
        error as its last observation.
        """
        raise NotImplementedError

    def scripted_turn(self, spec: PromptSpec, turns: Sequence[str]) -> str:
        """A reference player's next turn after `turns` (for `swarmrl env check` and tests).

        Raises:
            NotImplementedError: the environment has no scripted player.
        """
        raise NotImplementedError(f"{self.name} has no scripted player")

    @staticmethod
    def solved(info: dict[str, Any], turns: Sequence[str]) -> bool:
        """Whether an episode with these model turns solved its task (for `swarmrl eval`);
        the default: never (an environment without a notion of solving)."""
        return False


def is_episodic(env: Environment) -> bool:
    """Whether `env` plays multi-turn episodes."""
    return isinstance(env, EpisodeEnv)
