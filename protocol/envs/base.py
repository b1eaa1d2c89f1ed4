"""Environments: deterministic prompts plus reward functions (TRL conventions). Pure stdlib.

A prompt is a function of (job seed, index), so a worker cannot pick easy prompts and a validator
can recompute any of them. Indices `>= HELDOUT_START` form the held-out split: an environment
draws them from problems that training indices never produce.

Reward functions follow TRL's GRPOTrainer signature:
`f(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]`, where every key
of `PromptSpec.info` arrives as a kwarg holding one value per completion. `None` means "this
function does not apply"; the total is TRL's weighted nansum.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

RewardFunc = Callable[..., list[float | None]]

HELDOUT_START = 2**40
"""Indices at or above this are the held-out (evaluation) split; training uses [0, HELDOUT_START)."""

MAX_INDEX = 2**63 - 1


@dataclass(frozen=True)
class PromptSpec:
    """One prompt: its index, its text and the extra columns its reward functions read.

    `info` values must be plain data (int, float, str, bool, lists/dicts of those): they cross
    process boundaries and are compared by validators.
    """

    index: int
    text: str
    info: dict[str, Any] = field(default_factory=dict)
    messages: tuple[tuple[str, str], ...] = ()
    """(role, content) chat turns of the same prompt, rendered with the tokenizer's chat template
    when the job asks for it; empty: one user turn holding `text`."""
    response_prefix: str = ""
    """The start of the model's reply that the prompt writes (a reasoning job's ``<think>``): a chat
    prompt gets it after the template's generation prompt; a plain prompt's `text` already ends with it."""


class Environment(ABC):
    """A task: prompts derived from (seed, index) and the reward functions that grade completions.

    Class attributes (set by subclasses):
        name, version: the pinned identity a job names.
        reward_funcs: module-level functions (picklable: they run in a subprocess pool).
        reward_weights: one weight per function; the total is `total_reward`.
        reward_range: (low, high) bounds of the weighted total.
        regrade_tolerance: the largest |claimed - recomputed| total a validator accepts.
        stop: stop strings for sampling (the completion ends at the first one, which it keeps).
        max_new_tokens: the recommended generation budget (per turn for multi-turn environments).
        group_rewards: some reward function scores a group's rows together.
    """

    name: str
    version: str
    reward_funcs: tuple[RewardFunc, ...]
    reward_weights: tuple[float, ...]
    reward_range: tuple[float, float]
    regrade_tolerance: float
    stop: tuple[str, ...]
    max_new_tokens: int
    group_rewards: bool = False
    """True when a reward function compares the rows of a group (`protocol.envs.group_rewards`):
    graders then pass a `group` column (the prompt index of each row)."""

    @abstractmethod
    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The prompt at `index` for job seed `seed`; a pure function of (seed, index).

        Raises:
            ValueError: negative seed, or index outside [0, 2**63).
        """

    def prompts(self, seed: int, indices: Iterable[int]) -> list[PromptSpec]:
        """`[self.prompt(seed, i) for i in indices]`."""
        return [self.prompt(seed, i) for i in indices]

    def rewards(self, specs: Sequence[PromptSpec], completions: Sequence[str]) -> list[list[float | None]]:
        """Run every reward function in-process: one row `rewards_F` per completion.

        `specs[i]` is the prompt of `completions[i]` (repeat a spec G times for a group).

        Raises:
            ValueError: length mismatch, or a reward function returned the wrong number of values.
        """
        return grade(self.reward_funcs, specs, completions)

    def total(self, rewards_F: Sequence[float | None]) -> float | None:
        """`total_reward(rewards_F, self.reward_weights)`."""
        return total_reward(rewards_F, self.reward_weights)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version!r})"


def check_seed_index(seed: int, index: int) -> None:
    """Reject a seed or index a prompt cannot be derived from.

    Raises:
        ValueError: a non-int, a negative seed, or an index outside [0, 2**63).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index <= MAX_INDEX:
        raise ValueError(f"index must be an int in [0, 2**63), got {index!r}")


def reward_kwargs(specs: Sequence[PromptSpec]) -> dict[str, list[Any]]:
    """TRL-style kwargs: every `info` key becomes a list with one value per spec.

    Raises:
        ValueError: the specs do not all have the same info keys.
    """
    if not specs:
        return {}
    keys = set(specs[0].info)
    for spec in specs:
        if set(spec.info) != keys:
            raise ValueError(
                f"prompt {spec.index} has info keys {sorted(spec.info)}, expected {sorted(keys)}"
            )
    return {key: [spec.info[key] for spec in specs] for key in sorted(keys)}


def grade(
    reward_funcs: Sequence[RewardFunc], specs: Sequence[PromptSpec], completions: Sequence[str]
) -> list[list[float | None]]:
    """Apply each reward function to all completions; returns rows `rewards_F`, one per completion.

    Raises:
        ValueError: `len(specs) != len(completions)` or a function returned a wrong-length list.
    """
    if len(specs) != len(completions):
        raise ValueError(f"{len(specs)} prompts for {len(completions)} completions")
    prompts = [spec.text for spec in specs]
    kwargs = reward_kwargs(specs)
    columns = []
    for func in reward_funcs:
        values = list(func(prompts, list(completions), **kwargs))
        if len(values) != len(completions):
            raise ValueError(
                f"{func.__name__} returned {len(values)} values for {len(completions)} completions"
            )
        columns.append(values)
    return [list(row) for row in zip(*columns, strict=True)] if columns else [[] for _ in completions]


@dataclass(frozen=True)
class Grade:
    """The grade of one completion.

    reward: weighted total over the reward functions (TRL nansum semantics: functions returning
        None are skipped), None when grading failed or every function returned None.
    rewards: one value per reward function (None where it returned None or failed).
    error: "" on success, else "; "-joined `"<function name>: <what went wrong>"` entries, e.g.
        "correct: timeout after 5.0s", "fmt: ValueError: ...", "fmt: wrong length: got 3, want 4".
    """

    reward: float | None
    rewards: tuple[float | None, ...]
    error: str


def total_reward(rewards_F: Sequence[float | None], weights: Sequence[float]) -> float | None:
    """TRL's total: sum of weight * reward over functions that returned a number (None/NaN skipped).

    Returns None when every function returned None (or NaN).

    Raises:
        ValueError: length mismatch, or an infinite reward or weight.
    """
    if len(rewards_F) != len(weights):
        raise ValueError(f"{len(rewards_F)} rewards for {len(weights)} weights")
    total = 0.0
    seen = False
    for reward, weight in zip(rewards_F, weights, strict=True):
        if not math.isfinite(weight):
            raise ValueError(f"reward weight must be finite, got {weight}")
        if reward is None or math.isnan(reward):
            continue
        if math.isinf(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        total += weight * float(reward)
        seen = True
    return total if seen else None
