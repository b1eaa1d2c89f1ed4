"""Data-set tasks: a JSONL or Parquet file + field names + built-in rewards. No submitter code.

The job carries a `DatasetTask` (its `[environment]` table): the file's sha256, size, format and
per-chunk hashes (the content address workers fetch and verify it by), which fields hold the
prompt and the reference answer, an optional system prompt, prompt template and few-shot
examples, and a weighted list of built-in rewards (`protocol.envs.rewards`).

Split: a row is held out when a hash of (job seed, its prompt text) falls below
`heldout_fraction`, so duplicated prompts land on the same side and training never sees a
held-out prompt. Train rows are ordered by that hash; train index i is train row i mod n_train;
held-out index HELDOUT_START + k is held-out row k mod n_heldout. Prompts stay functions of
(seed, index), so validators recompute them.

Rewards get the answer field (`answer`) and the row fields they name in `*_field` parameters
(`row`, e.g. countdown's numbers; an empty one names the prompt field).

Rendering: `PromptSpec.text` is the plain prompt (system prompt, few-shot blocks
`template(q) + " " + a + "\\n"`, then `template(prompt)`); `PromptSpec.messages` holds the same
content as chat turns, which workers render with the tokenizer's chat template when
`chat_template` is set.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from swarmrl.protocol.envs.base import HELDOUT_START, Environment, PromptSpec, check_seed_index
from swarmrl.protocol.envs.rewards import BoundReward, build_reward, weighted_range

FIELD_PARAMS = {"countdown": "numbers_field"}
"""Rewards whose row-field parameter defaults to the task's prompt field."""
MAX_DATASET_BYTES = 32 << 20
"""Largest data-set file a job may carry (it travels inside the signed job to the trainer)."""
DATASET_CHUNK_BYTES = 1 << 20


class DatasetError(ValueError):
    """A data-set file that can't be used: the message names the rows and fields at fault."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RewardSpec(BaseModel):
    """One built-in reward of a data-set job: `{name, weight, **params}`."""

    model_config = ConfigDict(frozen=True, extra="allow")
    name: str
    weight: float = 1.0

    @property
    def params(self) -> dict[str, Any]:
        """The reward's parameters (every key but name and weight)."""
        return dict(self.model_extra or {})

    def build(self) -> BoundReward:
        """The checked, bound reward function (raises RewardConfigError)."""
        return build_reward(self.name, self.params)


class FewShot(_Frozen):
    """One worked example shown before every prompt."""

    prompt: str
    answer: str


class DatasetTask(_Frozen):
    """The `[environment]` table of a data-set job (what the signed job carries)."""

    dataset: str = Field(min_length=1, description="file name shown to users (the path at submit time)")
    dataset_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    dataset_size: int = Field(ge=1, le=MAX_DATASET_BYTES)
    dataset_format: Literal["jsonl", "parquet"] = "jsonl"
    dataset_chunks: tuple[str, ...] = Field(min_length=1, description="sha256 of each 1 MiB chunk, in order")
    prompt_field: str = Field(min_length=1)
    answer_field: str = Field(min_length=1)
    system_prompt: str = ""
    prompt_template: str = "{prompt}"
    few_shot: tuple[FewShot, ...] = ()
    chat_template: bool = False
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    rewards: tuple[RewardSpec, ...] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _default_fields(cls, data: Any) -> Any:
        """A reward's `*_field` parameter left empty names the prompt field (countdown's numbers),
        written into the spec so every grader reads the same field."""
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), (list, tuple)):
            return data
        rewards = []
        for r in data["rewards"]:
            spec = r.model_dump() if isinstance(r, RewardSpec) else r
            if isinstance(spec, dict) and spec.get("name") in FIELD_PARAMS and not spec.get(FIELD_PARAMS[spec["name"]]):
                spec = {**spec, FIELD_PARAMS[spec["name"]]: data.get("prompt_field", "")}
            rewards.append(spec)
        return {**data, "rewards": rewards}

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The row fields rewards read besides the answer (their `*_field` parameters), sorted."""
        return tuple(sorted({str(v) for r in self.rewards for k, v in r.params.items() if k.endswith("_field") and v}))

    @field_validator("dataset_chunks")
    @classmethod
    def _hex(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for h in v:
            if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
                raise ValueError(f"dataset_chunks entries must be hex sha256, got {h!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> DatasetTask:
        for r in self.rewards:
            r.build()
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {prompt}")
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"prompt_template: only {{prompt}} may be substituted ({exc})") from None
        if len(self.dataset_chunks) != -(-self.dataset_size // DATASET_CHUNK_BYTES):
            raise ValueError("dataset_chunks does not match dataset_size")
        return self


def sha256_hex(data: bytes) -> str:
    """The sha256 of `data` as 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


def chunk_hashes(data: bytes) -> tuple[str, ...]:
    """sha256 (hex) of each DATASET_CHUNK_BYTES chunk of `data`, in order."""
    return tuple(sha256_hex(data[i:i + DATASET_CHUNK_BYTES]) for i in range(0, max(len(data), 1), DATASET_CHUNK_BYTES))


def parse_rows(data: bytes, fmt: str, name: str = "dataset") -> list[dict[str, Any]]:
    """The file's rows as dicts (JSONL: one JSON object a line, blank lines skipped; Parquet via pyarrow).

    Raises:
        DatasetError: empty file, a line that is not UTF-8 or not a JSON object (with its line number),
            an unreadable Parquet file.
    """
    if not data.strip():
        raise DatasetError(f"{name}: the file is empty")
    if fmt == "parquet":
        return _parquet_rows(data, name)
    rows = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{name}: line {number} is not UTF-8 (byte {exc.start})") from None
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{name}: line {number} is not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{name}: line {number} is a JSON {type(row).__name__}, not an object")
        rows.append(row)
    if not rows:
        raise DatasetError(f"{name}: the file has no rows")
    return rows


def _parquet_rows(data: bytes, name: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        rows: list[dict[str, Any]] = pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DatasetError(f"{name}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    if not rows:
        raise DatasetError(f"{name}: the file has no rows")
    return rows


def _spans(numbers: Sequence[int], limit: int = 5) -> str:
    """1-based row numbers as "1-3, 7" (at most `limit` spans, then "...")."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans[:limit])
    return text + (", ..." if len(spans) > limit else "")


def check_fields(rows: Sequence[dict[str, Any]], fields: Sequence[str], name: str = "dataset") -> None:
    """Every row has every field, as a non-empty string or number.

    Raises:
        DatasetError: names the field, the rows (1-based) and, for a misspelling, the closest field present.
    """
    import difflib

    present = sorted({k for row in rows for k in row})
    for field_name in fields:
        missing = [i for i, row in enumerate(rows, start=1) if field_name not in row]
        if missing:
            where = "all rows" if len(missing) == len(rows) else f"rows {_spans(missing)} ({len(missing)} of {len(rows)})"
            close = difflib.get_close_matches(field_name, present, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; fields present: {', '.join(present[:12])}"
            raise DatasetError(f"{name}: field {field_name!r} missing in {where}{hint}")
        bad = [i for i, row in enumerate(rows, start=1)
               if isinstance(row[field_name], bool) or not isinstance(row[field_name], (str, int, float))
               or (isinstance(row[field_name], str) and not row[field_name].strip())]
        if bad:
            raise DatasetError(f"{name}: field {field_name!r} is empty or not text/number in rows {_spans(bad)}")


def duplicate_rows(rows: Sequence[dict[str, Any]], prompt_field: str, answer_field: str) -> int:
    """Rows whose (prompt, answer) already appeared earlier in the file."""
    seen: set[tuple[str, str]] = set()
    dups = 0
    for row in rows:
        key = (str(row[prompt_field]), str(row[answer_field]))
        dups += key in seen
        seen.add(key)
    return dups


class DatasetEnv(Environment):
    """A data-set task as an environment (see the module docstring for split and rendering)."""

    name = "dataset"
    version = "1"
    regrade_tolerance = 1e-6
    stop = ("\n",)
    max_new_tokens = 64

    def __init__(self, task: DatasetTask, data: bytes, seed: int) -> None:
        """Parse and split `data`; its sha256 must be the task's.

        Raises:
            DatasetError: the bytes are not the task's, or the rows are unusable.
        """
        if sha256_hex(data) != task.dataset_sha256:
            raise DatasetError(f"{task.dataset}: bytes do not match the job's sha256 {task.dataset_sha256[:12]}")
        self.task, self.seed = task, seed
        rows = parse_rows(data, task.dataset_format, task.dataset)
        check_fields(rows, [task.prompt_field, task.answer_field, *task.row_fields], task.dataset)
        self.rows = rows
        self.train_rows, self.heldout_rows = split_rows(rows, task.prompt_field, seed, task.heldout_fraction)
        if not self.train_rows or not self.heldout_rows:
            raise DatasetError(f"{task.dataset}: {split_advice(rows, task.prompt_field, seed, task.heldout_fraction)}")
        self.version = task.dataset_sha256[:16]
        bound = [r.build() for r in task.rewards]
        self.reward_funcs = tuple(bound)
        self.reward_weights = tuple(float(r.weight) for r in task.rewards)
        self.reward_range = weighted_range([r.name for r in task.rewards], self.reward_weights)

    def prompt(self, seed: int, index: int) -> PromptSpec:
        """The prompt of row `index` of the split it names (the job seed fixed the split).

        Raises:
            ValueError: a seed other than the job's, or a bad index.
        """
        check_seed_index(seed, index)
        if seed != self.seed:
            raise ValueError(f"this data-set task was split with seed {self.seed}, not {seed}")
        if index >= HELDOUT_START:
            row = self.heldout_rows[(index - HELDOUT_START) % len(self.heldout_rows)]
        else:
            row = self.train_rows[index % len(self.train_rows)]
        return render_row(self.task, row, index)


def split_rows(rows: Sequence[dict[str, Any]], prompt_field: str, seed: int,
               heldout_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, held-out): a row is held out when sha256(seed, prompt) < fraction, so every copy
    of a prompt lands on the same side. Each side is ordered by sha256(seed, prompt, k), k the
    row's occurrence of its prompt so far: copies of a prompt are spread through the order
    instead of adjacent (leases take consecutive indices, so adjacent copies would put one
    problem in several groups of a step)."""
    keyed = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        prompt = str(row[prompt_field])
        k = seen[prompt] = seen.get(prompt, -1) + 1
        order = hashlib.sha256(f"swarmrl-dataset-order:{seed}:{k}:{prompt}".encode()).digest()
        keyed.append((_held_out(prompt, seed, heldout_fraction), int.from_bytes(order[:8], "big"), i, row))
    keyed.sort(key=lambda x: (x[1], x[2]))
    return [r for held, _, _, r in keyed if not held], [r for held, _, _, r in keyed if held]


def _held_out(prompt: str, seed: int, heldout_fraction: float) -> bool:
    """Whether `prompt` (every copy of it) is held out under `seed`."""
    side = hashlib.sha256(f"swarmrl-dataset-split:{seed}:{prompt}".encode()).digest()
    return int.from_bytes(side[:8], "big") < heldout_fraction * 2**64


WANTED_HELDOUT = 3
"""Held-out prompts `split_advice` sizes its suggestions for (the expected count, not a rule)."""


def split_advice(rows: Sequence[dict[str, Any]], prompt_field: str, seed: int, heldout_fraction: float) -> str:
    """Why the split of `rows` has an empty side, in numbers (distinct prompts, how many the
    held-out fraction holds out under this seed, how many it would on average), and what to
    change: more distinct prompts, another heldout_fraction, or a seed that splits them."""
    import math

    prompts = sorted({str(row[prompt_field]) for row in rows})
    n, f = len(prompts), heldout_fraction
    held = sum(_held_out(p, seed, f) for p in prompts)
    side = "no prompt to train on" if held == n else "no held-out prompt"
    head = (f"{len(rows)} rows hold {n} distinct prompt{'s' * (n != 1)} (copies of a prompt stay on one side); "
            f"heldout_fraction {f:g} holds out {held} of them with seed {seed} (about {n * f:.1f} on average), "
            f"leaving {side}")
    if held == n:
        return f"{head}: lower [environment] heldout_fraction or add rows with new prompts"
    fixes = [(f"add rows with new prompts (about {math.ceil(WANTED_HELDOUT / f)} distinct prompts hold out "
             f"{WANTED_HELDOUT} on average)")]
    raised = math.ceil(100 * WANTED_HELDOUT / n) / 100
    if n > WANTED_HELDOUT and raised > f:   # a larger fraction, never a smaller one
        fixes.append(f"raise [environment] heldout_fraction to {raised:g}")
    tries = range(seed + 1, seed + 1 + max(1, min(1000, 200_000 // max(n, 1))))   # at most ~200k hashes
    good = next((s for s in tries if 0 < sum(_held_out(p, s, f) for p in prompts) < n), None)
    if good is not None:
        fixes.append(f"set seed = {good} (holds out {sum(_held_out(p, good, f) for p in prompts)})")
    return f"{head}: " + ", or ".join(fixes)


def render_row(task: DatasetTask, row: dict[str, Any], index: int) -> PromptSpec:
    """The PromptSpec of one row: plain text and chat turns (see the module docstring)."""
    question = task.prompt_template.format(prompt=str(row[task.prompt_field]))
    shots = "".join(f"{task.prompt_template.format(prompt=s.prompt)} {s.answer}\n" for s in task.few_shot)
    text = (f"{task.system_prompt}\n\n" if task.system_prompt else "") + shots + question
    messages: list[tuple[str, str]] = [("system", task.system_prompt)] if task.system_prompt else []
    for s in task.few_shot:
        messages += [("user", task.prompt_template.format(prompt=s.prompt)), ("assistant", s.answer)]
    messages.append(("user", question))
    info: dict[str, Any] = {"answer": str(row[task.answer_field])}
    if task.row_fields:   # the fields rewards read (e.g. countdown's numbers), as text
        info["row"] = {f: str(row[f]) for f in task.row_fields}
    return PromptSpec(index=index, text=text, info=info, messages=tuple(messages))
