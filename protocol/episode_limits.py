"""A job's admission limits, single-turn or multi-turn (one rule for trainers and validators)."""

from __future__ import annotations

from swarmrl.protocol.admission import AdmissionLimits
from swarmrl.protocol.envs.base import Environment
from swarmrl.protocol.envs.episode import EpisodeEnv, EpisodeSpec
from swarmrl.protocol.jobspec import JobSpec


def episode_limits(spec: JobSpec, env: Environment) -> EpisodeSpec | None:
    """The job's episode limits: its `episode` setting, else defaults capped at the environment's
    own turn limit; None for a single-turn environment."""
    if not isinstance(env, EpisodeEnv):
        return None
    if spec.episode is not None:
        return spec.episode
    return EpisodeSpec(max_turns=min(EpisodeSpec().max_turns, env.max_turns))


def completion_budget(spec: JobSpec, env: Environment) -> int:
    """Tokens one completion may hold: `sampling.max_new_tokens`, or an episode's `max_tokens`."""
    limits = episode_limits(spec, env)
    return spec.sampling.max_new_tokens if limits is None else limits.max_tokens


def job_limits(spec: JobSpec, env: Environment, vocab_size: int) -> AdmissionLimits:
    """The admission limits of a job whose environment is `env`, on a model of `vocab_size` ids."""
    limits = episode_limits(spec, env)
    return AdmissionLimits(
        group_size=spec.group_size, vocab_size=vocab_size, max_prompt_tokens=spec.max_prompt_tokens,
        max_new_tokens=completion_budget(spec, env), reward_range=env.reward_range,
        num_reward_funcs=len(env.reward_funcs), max_async_level=spec.max_async_level,
        max_turns=0 if limits is None else limits.max_turns,
    )
