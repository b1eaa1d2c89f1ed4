"""Installed environments, pinned by (name, version), and the held-out split helper."""

from __future__ import annotations

from swarmrl.protocol.envs.arithmetic import ArithmeticEnv
from swarmrl.protocol.envs.base import (
    HELDOUT_START,
    Environment,
    PromptSpec,
    RewardFunc,
    grade,
    reward_kwargs,
    total_reward,
)

# name -> version -> environment class
ENVIRONMENTS: dict[str, dict[str, type[Environment]]] = {
    ArithmeticEnv.name: {ArithmeticEnv.version: ArithmeticEnv},
}

__all__ = [
    "ENVIRONMENTS",
    "HELDOUT_START",
    "Environment",
    "PromptSpec",
    "RewardFunc",
    "get_environment",
    "grade",
    "heldout_indices",
    "heldout_prompts",
    "reward_kwargs",
    "total_reward",
]


def get_environment(name: str, version: str | None = None) -> Environment:
    """The installed environment `name` at `version` (default: its newest version).

    Raises:
        ValueError: unknown name or version (the message lists the known ones).
    """
    versions = ENVIRONMENTS.get(name)
    if versions is None:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    if version is None:
        version = max(versions, key=lambda v: (len(v), v))
    if version not in versions:
        raise ValueError(f"unknown version {version!r} of environment {name!r}; known: {sorted(versions)}")
    return versions[version]()


def heldout_indices(n: int) -> range:
    """The first `n` held-out indices: [HELDOUT_START, HELDOUT_START + n).

    Raises:
        ValueError: negative n.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return range(HELDOUT_START, HELDOUT_START + n)


def heldout_prompts(env: Environment, n: int, seed: int) -> list[PromptSpec]:
    """`n` evaluation prompts, from indices training never uses (>= HELDOUT_START).

    Environments draw held-out indices from problems that training indices never produce (for
    `arithmetic`: a fixed hash split of the problems), so evaluation never sees a training prompt.

    Raises:
        ValueError: negative n or seed.
    """
    return env.prompts(seed, heldout_indices(n))
