"""The `[environment]` table of a reasoning-gym job: task(s), configuration, format. Plain data.

reasoning-gym (Apache-2.0, `reasoning-gym==0.1.25`) ships ~100 procedural task families, each a
dataclass configuration (difficulty ranges, sizes) and a `score_answer` verifier. A job names one
task or a weighted mix; the environment (`protocol.envs.rg_env`) builds each task's data set from
its configuration and a seed derived from the job seed. In a job file:

    [environment]
    reasoning_gym = "chain_sum"                      # one task ...
    config = {min_terms = 2, max_terms = 3, max_digits = 1}
    reasoning_format = "think_answer"                # or "answer"; see protocol.envs.reasoning_format
    chat_template = true

    # ... or a weighted mix:
    # [[environment.reasoning_gym]]
    # task = "chain_sum"
    # weight = 2.0
    # config = {max_digits = 2}

`seed` is not a configuration field a job may set (the job seed derives it, so workers can't choose
prompts); `size` is (the number of problems a task draws from, reasoning-gym's default 500 when
unset). `rg_version` pins the reasoning-gym release the prompts and scorers come from; the submitter
side fills it from its installed copy, and a node with another release refuses the job.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmrl.protocol.envs.reasoning_format import ReasoningFormat

MAX_TASKS = 64
RESERVED_CONFIG = ("seed",)
"""Configuration fields the job sets itself (the seed is derived from the job seed)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RGTaskEntry(_Frozen):
    """One task of a reasoning-gym job: its registered name, its weight in the mix, its configuration."""

    task: str = Field(min_length=1, max_length=128)
    weight: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("config")
    @classmethod
    def _plain(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            if not _is_plain(value):
                raise ValueError(f"config field {key!r}: only numbers, text, booleans and lists of them")
        return v


def _is_plain(value: Any) -> bool:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return True
    return isinstance(value, list) and all(_is_plain(x) for x in value)


class ReasoningGymTask(_Frozen):
    """The `[environment]` table of a reasoning-gym job (what the signed job carries)."""

    reasoning_gym: tuple[RGTaskEntry, ...] = Field(min_length=1, max_length=MAX_TASKS)
    rg_version: str = Field("", max_length=32, description="reasoning-gym release; '' = the installed one")
    reasoning_format: ReasoningFormat = "think_answer"
    system_prompt: str | None = Field(None, description="None: the format's instructions (reasoning_format)")
    chat_template: bool = False
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)

    @model_validator(mode="before")
    @classmethod
    def _one_task(cls, data: Any) -> Any:
        """`reasoning_gym = "NAME"` with a sibling `config` table is a mix of one task."""
        if isinstance(data, dict) and isinstance(data.get("reasoning_gym"), str):
            data = dict(data)
            data["reasoning_gym"] = [{"task": data.pop("reasoning_gym"), "config": data.pop("config", {})}]
        return data

    @property
    def weights(self) -> tuple[float, ...]:
        """The tasks' weights, in order."""
        return tuple(t.weight for t in self.reasoning_gym)

    @property
    def label(self) -> str:
        """A short description: "chain_sum" or "chain_sum x2, leg_counting x1"."""
        if len(self.reasoning_gym) == 1:
            return self.reasoning_gym[0].task
        return ", ".join(f"{t.task} x{t.weight:g}" for t in self.reasoning_gym)
