"""Job specifications: what a submitter asks the swarm to train, as plain validated data.

A `JobSpec` is canonical JSON on the wire (inside a signed `Job`); the job id is derived from
the signed body, so two submissions of the same spec at different times are different jobs.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from swarmrl.protocol.envs.dataset import DatasetTask
from swarmrl.protocol.envs.episode import EpisodeSpec
from swarmrl.protocol.envs.rg_task import ReasoningGymTask
from swarmrl.protocol.grpo.config import LossConfig
from swarmrl.protocol.market import MAX_WEIGHT


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _task_kind(value: Any) -> str:
    """Which kind of `environment` a value is: an installed environment's name, a data-set table, or a
    reasoning-gym table (it names `reasoning_gym`), so a bad table's errors name only its own fields."""
    if isinstance(value, str):
        return "installed"
    if isinstance(value, ReasoningGymTask) or (isinstance(value, dict) and "reasoning_gym" in value):
        return "reasoning_gym"
    return "dataset"


SyncMode = Literal["every_step", "diloco"]
OuterCodec = Literal["float32", "int8"]
BatchGroups = Annotated[int, Field(ge=1, le=4096)]
Environment = Annotated[Annotated[str, Tag("installed")] | Annotated[DatasetTask, Tag("dataset")]
                        | Annotated[ReasoningGymTask, Tag("reasoning_gym")], Discriminator(_task_kind)]


class LoraSpec(_Frozen):
    """LoRA shape of the job's adapter (Hu et al. 2021); "all-linear" excludes lm_head."""

    rank: int = Field(16, ge=1, le=256)
    alpha: int = Field(32, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: str | tuple[str, ...] = "all-linear"


class SamplingSpec(_Frozen):
    """How workers sample; temperature also scales the trainer's log-probs (same distribution)."""

    temperature: float = Field(1.0, gt=0.0, le=4.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(12, ge=1, le=4096)
    stop: tuple[str, ...] = ("\n",)


class JobSpec(_Frozen):
    """A training job: base model, environment, GRPO hyper-parameters and limits.

    `base_model` is any causal LM: a built-in name ("tiny", "google/gemma-3-270m"), a Hugging Face
    model folder or a hub id already in the local cache; `base_model_sha256` pins the exact weights
    (hex sha256, see node.models.base_model.base_model_sha256); workers whose local copy differs refuse the job.
    `environment` is an installed environment's name (with `env_version` and, optionally,
    `env_package_sha256`: the hash of its installed package as `swarmrl env list` shows it, filled
    at submit time; workers whose package differs refuse the job), a data-set task, or a
    reasoning-gym task table (`protocol.envs.rg_task`).
    """

    name: str = Field("job", min_length=1, max_length=64)
    base_model: str = Field(min_length=1, max_length=512)
    base_model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    environment: Environment = "arithmetic"
    env_version: str = "1"
    env_package_sha256: str = Field("", pattern=r"^([0-9a-f]{64})?$",
                                    description="an installed environment's package hash ('' = any)")
    seed: int = Field(0, ge=0, lt=2**63)
    group_size: int = Field(8, ge=2, le=256, description="G: completions per prompt")
    batch_groups: BatchGroups | tuple[BatchGroups, BatchGroups] = Field(
        8, description="groups per optimizer step: a number, or a range [min, max] (elastic intake: a step "
                       "takes every trainable pending group up to max once min are there)")
    prompts_per_lease: int = Field(4, ge=1, le=256)
    steps: int = Field(100, ge=1, le=1_000_000)
    learning_rate: float = Field(1e-4, gt=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    max_async_level: int = Field(2, ge=0, le=64, description="max policy versions a rollout may lag")
    delta_codec: Literal["int4", "int8", "float32"] = Field(
        "int4", description="how each version's adapter delta is encoded (protocol/delta_codec.py)")
    lease_ttl_s: float = Field(120.0, gt=0.0)
    max_prompt_tokens: int = Field(256, ge=1)
    lora: LoraSpec = LoraSpec()
    sampling: SamplingSpec = SamplingSpec()
    loss: LossConfig = LossConfig()
    validation_rate: float = Field(0.25, ge=0.0, le=1.0, description="share of batches validators check")
    episode: EpisodeSpec | None = Field(None, description="multi-turn limits (None: the environment's defaults)")
    weight: float = Field(1.0, gt=0.0, le=MAX_WEIGHT,
                          description="the job's share of the swarm when demand exceeds supply, relative to other "
                                      "jobs' (protocol/market.py); a trainer refuses one above its cap")
    sync: SyncMode = Field("every_step", description="how the job's trainers agree: average gradients at every "
                                                     "step, or DiLoCo outer steps every inner_steps (protocol/diloco.py)")
    inner_steps: int = Field(8, ge=1, le=10_000, description="DiLoCo's H: a trainer's own steps between outer steps")
    outer_learning_rate: float = Field(0.7, gt=0.0, le=10.0, description="the outer Nesterov SGD's learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="the outer Nesterov SGD's momentum, in [0, 1)")
    outer_timeout_s: float = Field(60.0, gt=0.0, le=3600.0,
                                   description="how long an outer round waits for the job's other trainers")
    outer_codec: OuterCodec = Field("int8", description="how pseudo-gradients travel in an outer round: int8 "
                                                        "(hivemind's uniform 8-bit, with error feedback) or float32")
    lease_filter: Literal["none", "signal"] = Field(
        "none", description="which prompt indices the trainer leases: every one in order ('none'), or ('signal') "
                            "pass over most of those whose prompt's last group had all-equal rewards "
                            "(protocol/prompt_signal.py)")

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.loss.loss_constant is not None and self.loss.loss_constant < self.sampling.max_new_tokens:
            raise ValueError("loss.loss_constant must be >= sampling.max_new_tokens")
        if self.batch_min > self.batch_max:
            raise ValueError(f"batch_groups [{self.batch_min}, {self.batch_max}]: min must be <= max")
        stray = sorted(set(_DILOCO_FIELDS[1:]) & self.model_fields_set) if not self.diloco else []
        if stray:
            raise ValueError(f"{stray[0]} is a DiLoCo setting: it needs sync = \"diloco\"")
        if self.sync == "diloco" and self.steps % self.inner_steps:
            raise ValueError(f"steps ({self.steps}) must be a multiple of inner_steps ({self.inner_steps}) "
                             "with sync = \"diloco\" (a job ends on an outer step)")
        return self

    @property
    def batch_min(self) -> int:
        """The fewest groups a step trains on (`batch_groups`, or its range's min)."""
        return self.batch_groups if isinstance(self.batch_groups, int) else self.batch_groups[0]

    @property
    def batch_max(self) -> int:
        """The most groups a step trains on (`batch_groups`, or its range's max)."""
        return self.batch_groups if isinstance(self.batch_groups, int) else self.batch_groups[1]

    @property
    def dataset(self) -> DatasetTask | None:
        """The data-set task, or None for an installed environment."""
        return self.environment if isinstance(self.environment, DatasetTask) else None

    @property
    def reasoning_gym(self) -> ReasoningGymTask | None:
        """The reasoning-gym task table, or None."""
        return self.environment if isinstance(self.environment, ReasoningGymTask) else None

    @property
    def carries_task(self) -> bool:
        """Whether the job carries its task as a table (a data set or reasoning-gym tasks: built-in
        code, no installed environment to announce or pin), rather than naming an installed one."""
        return not isinstance(self.environment, str)

    @property
    def environment_id(self) -> str:
        """A short name of the task: the installed environment's name, "dataset:<sha256[:16]>", or
        "reasoning_gym:<sha256[:16] of the task table>"."""
        if isinstance(self.environment, str):
            return self.environment
        task = self.dataset
        if task is not None:
            return f"dataset:{task.dataset_sha256[:16]}"
        table = json.dumps(self.environment.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return f"reasoning_gym:{hashlib.sha256(table.encode()).hexdigest()[:16]}"   # canonical: key order aside

    @property
    def environment_version(self) -> str:
        """`env_version` for an installed environment; the data set's sha256 prefix for a data-set
        task; the pinned reasoning-gym release for reasoning-gym tasks."""
        if isinstance(self.environment, ReasoningGymTask):
            return self.environment.rg_version
        task = self.dataset
        return self.env_version if task is None else task.dataset_sha256[:16]

    @property
    def chat_template(self) -> bool:
        """Whether prompts are rendered with the tokenizer's chat template."""
        return bool(not isinstance(self.environment, str) and self.environment.chat_template)

    @property
    def diloco(self) -> bool:
        """Whether the job's trainers sync by DiLoCo outer steps (`sync = "diloco"`)."""
        return self.sync == "diloco"

    def sync_settings(self) -> dict[str, Any]:
        """The settings cotrainers of one job must share: `sync`, and with DiLoCo its outer
        optimizer (`inner_steps`, `outer_learning_rate`, `outer_momentum`) and `outer_codec`."""
        if not self.diloco:
            return {"sync": self.sync}
        return {"sync": self.sync, "inner_steps": self.inner_steps, "outer_learning_rate": self.outer_learning_rate,
                "outer_momentum": self.outer_momentum, "outer_codec": self.outer_codec}

    def canonical_json(self) -> str:
        """Sorted-key, compact JSON: the exact text that is signed and hashed. The sync fields
        appear only for a DiLoCo job and `lease_filter` only when set, so the ids of jobs that
        don't use them stay as they were."""
        data = self.model_dump(mode="json")
        if not self.diloco:
            for key in _DILOCO_FIELDS:
                data.pop(key)
        if self.lease_filter == "none":
            data.pop("lease_filter")
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """Parse and validate (raises pydantic.ValidationError on bad input)."""
        return cls.model_validate_json(text)


_DILOCO_FIELDS = ("sync", "inner_steps", "outer_learning_rate", "outer_momentum", "outer_timeout_s", "outer_codec")


def job_id_from_body(body: bytes) -> str:
    """Job id: first 16 bytes of sha256 of the signed `Job` body, hex (32 characters)."""
    return hashlib.sha256(b"swarmrl-job\x00" + body).hexdigest()[:32]


ModelName = str
"""A base model: a built-in name ("tiny", "google/gemma-3-270m"), a model folder or a cached hub id."""
