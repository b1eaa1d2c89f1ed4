"""reasoning-gym tasks as an environment: prompts from (job seed, index), its own scorers as rewards.

The task table (`protocol.envs.rg_task.ReasoningGymTask`) names one task or a weighted mix. Each
task's data set is built once from its configuration with a seed derived from the job seed and its
place in the mix (`dataset_seed`), so every node builds the same one. Prompt `index`:
1. the task: a weighted draw from `random.Random("swarmrl-rg-v1:task:{seed}:{index}")` (a mix only);
2. the problem: row `k_j = sha256("swarmrl-rg-v1:row:{seed}:{index}:{j}") mod size` of that data set,
   for j = 0, 1, ... until the row's question falls on the index's side of the split;
3. the split: a question is held out when sha256(seed, task, question) < `heldout_fraction`, so a
   question that several rows produce is on one side only, and held-out indices (>= HELDOUT_START)
   never show a training problem.
Workers can't choose prompts, and validators and graders recompute them (and the entry a scorer
reads) from (seed, index) alone.

Rewards (`RGCorrect`, `RGFormat`, run in the sandboxed grading pool like every environment's):
the task's own `score_answer(answer, entry)` on the answer read in the job's reasoning format
(`protocol.envs.reasoning_format`: an incomplete or truncated completion scores 0), weight 1.0,
plus 0.1 for a completion in the format; total in [0, 1.1]. A scorer that raises on one completion
gives that completion a non-finite value, which the grading pool records as that completion's
failure (unscored, reward None), not the batch's.

Submit-time errors (`RGTaskError`, one line naming the field): an unknown task, a configuration
field the task does not take, a value its configuration refuses, another reasoning-gym release.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
import math
import random
from collections.abc import Sequence
from typing import Any

from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index
from swarmrl.protocol.envs.reasoning_format import STOP, format_instructions, parse_reasoning, response_prefix
from swarmrl.protocol.envs.rg_task import RESERVED_CONFIG, ReasoningGymTask, RGTaskEntry

PACKAGE = "reasoning-gym"
MAX_DRAWS = 256
"""Rows tried for one index before giving up (a train index needs ~1.1, a held-out one ~1/fraction)."""
_ENTRY_CACHE = 4096


class RGTaskError(ValueError):
    """A reasoning-gym task table that can't be built: one line naming the field at fault."""


def installed_version() -> str:
    """The installed reasoning-gym release ("0.1.25").

    Raises:
        RGTaskError: reasoning-gym is not installed.
    """
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RGTaskError(f"reasoning-gym jobs need the {PACKAGE} package (pip install {PACKAGE}==0.1.25)") from None


def task_names() -> list[str]:
    """Every registered reasoning-gym task, sorted."""
    import reasoning_gym  # noqa: F401 - registers the tasks
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_fields(name: str) -> dict[str, Any]:
    """A task's configuration fields and their defaults (seed excluded)."""
    from reasoning_gym.factory import DATASETS

    _, config_cls = DATASETS[name]
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name == "seed":
            continue
        has_default = f.default is not dataclasses.MISSING
        out[f.name] = f.default if has_default else (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                                     else ...)
    return out


def dataset_seed(job_seed: int, position: int, task: str) -> int:
    """The seed of the `position`-th task's data set: 32 bits of sha256(job seed, position, task)."""
    digest = hashlib.sha256(f"swarmrl-rg-v1:dataset:{job_seed}:{position}:{task}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def build_dataset(entry: RGTaskEntry, position: int, job_seed: int) -> Any:
    """The reasoning-gym data set of one task of the mix.

    Raises:
        RGTaskError: unknown task, unknown configuration field, a value the configuration refuses.
    """
    where = f"environment.reasoning_gym[{position}]"
    names = task_names()
    if entry.task not in names:
        close = difflib.get_close_matches(entry.task, names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "swarmrl env list names them"
        raise RGTaskError(f"{where}.task: unknown reasoning-gym task {entry.task!r} ({hint}; {len(names)} tasks)")
    fields = task_fields(entry.task)
    for key in entry.config:
        if key in RESERVED_CONFIG:
            raise RGTaskError(f"{where}.config.{key}: set from the job seed (so workers can't choose prompts); remove it")
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"did you mean {close[0]!r}" if close else f"its fields: {', '.join(fields)}"
            raise RGTaskError(f"{where}.config.{key}: {entry.task} takes no field {key!r} ({hint})")
    from reasoning_gym.factory import DATASETS

    dataset_cls, config_cls = DATASETS[entry.task]
    try:
        config = config_cls(**entry.config, seed=dataset_seed(job_seed, position, entry.task))
        if hasattr(config, "validate"):
            config.validate()
        return dataset_cls(config=config)
    except (AssertionError, ValueError, TypeError, KeyError) as exc:
        named = [k for k in entry.config if k in str(exc)] or [k for k in fields if k in str(exc)]
        field = f".{named[0]}" if named else ""
        raise RGTaskError(f"{where}.config{field}: {entry.task} refuses its configuration: "
                          f"{str(exc) or type(exc).__name__}") from None


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class ReasoningGymEnv(Environment):
    """A reasoning-gym task (or mix) as an environment; see the module docstring."""

    name = "reasoning_gym"
    regrade_tolerance = 1e-6
    stop = STOP
    max_new_tokens = 256
    reward_weights = (1.0, 0.1)
    reward_range = (0.0, 1.1)

    def __init__(self, task: ReasoningGymTask, seed: int) -> None:
        """Build every task's data set for job seed `seed`.

        Raises:
            RGTaskError: another reasoning-gym release than the task pins, or a task that can't be built.
        """
        check_seed_index(seed, 0)
        self.version = installed_version()
        if task.rg_version and task.rg_version != self.version:
            raise RGTaskError(f"environment.rg_version: the job pins reasoning-gym {task.rg_version}, "
                              f"this node has {self.version}")
        self.task, self.seed = task, seed
        self.datasets = [build_dataset(e, i, seed) for i, e in enumerate(task.reasoning_gym)]
        self.format = task.reasoning_format
        self.system_prompt = task.system_prompt if task.system_prompt is not None else format_instructions(self.format)
        self._entries: dict[tuple[int, int], dict[str, Any]] = {}
        self.reward_funcs = (RGCorrect(self), RGFormat(self))

    def entry(self, position: int, row: int) -> dict[str, Any]:
        """Row `row` of the `position`-th task's data set (its question, answer and metadata)."""
        key = (position, row)
        entry = self._entries.get(key)
        if entry is None:   # a local value: another thread (the trainer's gRPC pool) may clear the cache
            entry = self.datasets[position][row]
            if len(self._entries) >= _ENTRY_CACHE:
                self._entries.clear()
            self._entries[key] = entry
        return entry

    def heldout(self, position: int, question: str) -> bool:
        """Whether a question of the `position`-th task belongs to the held-out split."""
        name = self.task.reasoning_gym[position].task
        return _hash64(f"swarmrl-rg-v1:split:{self.seed}:{name}:{question}") < self.task.heldout_fraction * 2**64

    def locate(self, index: int) -> tuple[int, int]:
        """(task position, row) of prompt `index` (see the module docstring).

        Raises:
            RGTaskError: no row on the index's side of the split within MAX_DRAWS draws.
        """
        check_seed_index(self.seed, index)
        position = 0
        if len(self.datasets) > 1:
            rng = random.Random(f"swarmrl-rg-v1:task:{self.seed}:{index}")
            position = rng.choices(range(len(self.datasets)), weights=self.task.weights)[0]
        size = len(self.datasets[position])
        want = index >= HELDOUT_START
        for j in range(MAX_DRAWS):
            row = _hash64(f"swarmrl-rg-v1:row:{self.seed}:{index}:{j}") % size
            if self.heldout(position, str(self.entry(position, row)["question"])) == want:
                return position, row
        side = "held-out" if want else "training"
        raise RGTaskError(f"environment.reasoning_gym[{position}]: no {side} problem in {MAX_DRAWS} draws of "
                          f"{size} rows; raise its config size (or heldout_fraction)")

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The prompt at `index`: system prompt + the task's question, the reply opened as the format wants.

        Raises:
            ValueError: a seed other than the job's, a bad index, or RGTaskError from `locate`.
        """
        check_seed_index(seed, index)
        if seed != self.seed:
            raise ValueError(f"this reasoning-gym environment was built for seed {self.seed}, not {seed}")
        position, row = self.locate(index)
        entry = self.entry(position, row)
        question, prefix = str(entry["question"]), response_prefix(self.format)
        text = f"{self.system_prompt}\n\nQuestion: {question}\nAnswer: {prefix}"
        info = {"answer": str(entry["answer"]), "rg_task": position, "rg_row": row}
        return PromptSpec(index=index, text=text, info=info,
                          messages=(("system", self.system_prompt), ("user", question)), response_prefix=prefix)

    def score(self, completion: str, position: int, row: int) -> float:
        """The task's own score of the completion's answer, 0.0 when it is not complete in the format.

        Raises what the task's scorer raises.
        """
        parsed = parse_reasoning(completion, self.format)
        if not parsed.complete:
            return 0.0
        value = float(self.datasets[position].score_answer(parsed.answer, self.entry(position, row)))
        return min(1.0, max(0.0, value)) if math.isfinite(value) else math.nan


class RGCorrect:
    """Reward: the task's `score_answer` of the completion (TRL signature; NaN where the scorer raised)."""

    __name__ = "rg_correct"

    def __init__(self, env: ReasoningGymEnv) -> None:
        self.env = env

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], rg_task: Sequence[int] = (),
                 rg_row: Sequence[int] = (), **kwargs: Any) -> list[float | None]:
        """One score per completion."""
        if not len(completions) == len(rg_task) == len(rg_row):
            raise ValueError(f"{len(completions)} completions, {len(rg_task)} tasks, {len(rg_row)} rows")
        out: list[float | None] = []
        for completion, position, row in zip(completions, rg_task, rg_row, strict=True):
            try:
                out.append(self.env.score(completion, int(position), int(row)))
            except Exception:  # noqa: BLE001 - a scorer's failure marks this completion only
                out.append(math.nan)
        return out


class RGFormat:
    """Reward: 1.0 for a completion complete in the job's reasoning format, else 0.0 (TRL signature)."""

    __name__ = "rg_format"

    def __init__(self, env: ReasoningGymEnv) -> None:
        self.env = env

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kwargs: Any) -> list[float | None]:
        """One value per completion."""
        return [1.0 if parse_reasoning(c, self.env.format).complete else 0.0 for c in completions]
