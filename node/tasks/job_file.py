"""Job files (JOB.toml) and their tasks: load, check at submit time, build the environment.

A job file is a `JobSpec` in TOML whose `[environment]` table may name a data-set file by path;
`load_job_file` reads that file, pins its sha256, size and chunk hashes in the spec (an installed
environment: its package hash, `env_package_sha256`), and checks
everything a worker would trip over, before any worker sees the job: the rows parse (UTF-8, one
JSON object a line, or Parquet), the prompt and answer fields exist in every row, the rewards
are known and well-formed, every prompt rendered exactly as workers render it fits in
`max_prompt_tokens`; duplicate rows are counted and warned about. Errors are one line.
"""

from __future__ import annotations

import logging
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmrl.node.models.base_model import find_base_model
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.tasks.builtin_jobs import _merge, builtin_job
from swarmrl.protocol.envs import heldout_indices, installed_environments, job_environment
from swarmrl.protocol.envs.base import Environment, PromptSpec
from swarmrl.protocol.envs.dataset import (
    MAX_DATASET_BYTES,
    DatasetEnv,
    DatasetError,
    chunk_hashes,
    duplicate_rows,
    render_row,
    sha256_hex,
)
from swarmrl.protocol.envs.reasoning_format import STOP
from swarmrl.protocol.envs.rg_env import ReasoningGymEnv, RGTaskError, installed_version
from swarmrl.protocol.jobspec import JobSpec

log = logging.getLogger(__name__)
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class TaskReport:
    """What the submit-time check found (printed by `swarmrl env check`)."""

    rows: int = 0
    train_rows: int = 0
    heldout_rows: int = 0
    duplicates: int = 0
    prompt_tokens: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class LoadedJob:
    """A checked job: its spec, its data-set bytes (None for an installed environment), the report."""

    spec: JobSpec
    dataset: bytes | None
    report: TaskReport


def load_job_file(path: Path, cache_dir: Path | None = None, overrides: dict[str, Any] | None = None,
                  base_model: str | None = None, tokenizer: Any = None) -> LoadedJob:
    """Read JOB.toml (+ `-j` overrides, + a base-model override), pin and check its task.

    Raises:
        ValueError (DatasetError, pydantic.ValidationError): anything a worker would refuse, in one line.
    """
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    _merge(data, overrides or {})
    model = base_model or data.pop("base_model", "tiny")
    data.pop("base_model", None)
    data.pop("base_model_sha256", None)
    dataset = None
    env = data.get("environment")
    if isinstance(env, dict) and "reasoning_gym" in env:
        data["environment"] = pin_reasoning_gym(env)
        data.setdefault("name", "reasoning-gym")
        sampling = data.setdefault("sampling", {})   # the format's stop and length, unless the file says
        sampling.setdefault("stop", list(STOP))
        sampling.setdefault("max_new_tokens", ReasoningGymEnv.max_new_tokens)
    elif isinstance(env, dict):
        data["environment"], dataset = pin_dataset(env, Path(path).parent)
        data.setdefault("name", Path(env["dataset"]).stem[:64] or "dataset")
    spec = builtin_job(model, cache_dir, **data)
    tok = tokenizer if tokenizer is not None else load_tokenizer(spec.base_model, cache_dir)
    report = check_task(spec, dataset, tok)
    if not spec.carries_task and not spec.env_package_sha256:
        spec = spec.model_copy(update={"env_package_sha256": package_pin(spec.environment_id, spec.env_version)})
    return LoadedJob(spec, dataset, report)


def package_pin(name: str, version: str) -> str:
    """The package hash a job on installed environment `name` `version` pins: the submitter's
    installed package's (as `swarmrl env list` shows it); "" for a built-in (swarmrl's own
    environments are pinned by their version, as the rest of the protocol is) or one not installed."""
    for e in installed_environments():
        if e.name == name and e.version == version and e.package not in ("", "swarmrl"):
            return e.package_sha256
    return ""


def pin_reasoning_gym(env: dict[str, Any]) -> dict[str, Any]:
    """A reasoning-gym table with `rg_version` pinned to the installed release (unless it names one).

    Raises:
        RGTaskError: reasoning-gym is not installed.
    """
    return {**env, "rg_version": env.get("rg_version") or installed_version()}


def pin_dataset(env: dict[str, Any], base_dir: Path) -> tuple[dict[str, Any], bytes]:
    """The environment table with `dataset` read from disk and pinned (sha256, size, format, chunks).

    Raises:
        DatasetError: no such file, an unknown extension, an empty file or one over MAX_DATASET_BYTES.
    """
    if "dataset" not in env:
        raise DatasetError("[environment] table needs a dataset = \"FILE.jsonl|FILE.parquet\" key "
                           "(or write environment = \"NAME\" for an installed environment)")
    file = Path(str(env["dataset"])).expanduser()
    file = file if file.is_absolute() else base_dir / file
    if not file.is_file():
        raise DatasetError(f"data set {file}: no such file")
    fmt = env.get("dataset_format") or FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise DatasetError(f"data set {file.name}: unknown format {file.suffix!r}; use .jsonl or .parquet "
                           "(or set dataset_format)")
    size = file.stat().st_size
    if size > MAX_DATASET_BYTES:
        raise DatasetError(f"data set {file.name}: {size} bytes is over the {MAX_DATASET_BYTES >> 20} MiB limit")
    if size == 0:
        raise DatasetError(f"data set {file.name}: the file is empty")
    raw = file.read_bytes()
    pinned = {**env, "dataset": file.name, "dataset_sha256": sha256_hex(raw), "dataset_size": len(raw),
              "dataset_format": fmt, "dataset_chunks": list(chunk_hashes(raw))}
    return pinned, raw


def load_tokenizer(base_model: str, cache_dir: Path | None = None) -> Any:
    """The base model's tokenizer (no weights loaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(find_base_model(base_model, cache_dir))


def check_task(spec: JobSpec, dataset: bytes | None, tokenizer: Any) -> TaskReport:
    """Build the job's environment and check every data-set row as workers will render it.

    Raises:
        DatasetError: bad rows or fields, a prompt longer than `max_prompt_tokens` (first such row).
        ValueError: an environment that is not installed here.
    """
    report = TaskReport()
    env = job_environment(spec, dataset)
    if isinstance(env, ReasoningGymEnv):   # train and held-out prompts: every task of the mix draws rows
        prompts = env.prompts(spec.seed, [*range(8), *heldout_indices(4)])
        report.prompt_tokens = [len(render_prompt(tokenizer, p, spec.chat_template)) for p in prompts]
        longest = max(report.prompt_tokens)
        if longest > spec.max_prompt_tokens:
            raise RGTaskError(f"max_prompt_tokens: a prompt of {spec.environment.label} renders to "  # type: ignore[union-attr]
                              f"{longest} tokens, over max_prompt_tokens {spec.max_prompt_tokens}; raise it")
        return report
    if not isinstance(env, DatasetEnv):
        prompts = env.prompts(spec.seed, range(3))
        report.prompt_tokens = [len(render_prompt(tokenizer, p, spec.chat_template)) for p in prompts]
        return report
    task = env.task
    report.rows, report.train_rows, report.heldout_rows = len(env.rows), len(env.train_rows), len(env.heldout_rows)
    report.duplicates = duplicate_rows(env.rows, task.prompt_field, task.answer_field)
    if report.duplicates:
        report.warnings.append(f"{report.duplicates} duplicate rows (same prompt and answer) in {task.dataset}")
    for number, row in enumerate(env.rows, start=1):
        n = len(render_prompt(tokenizer, render_row(task, row, 0), task.chat_template))
        if n > spec.max_prompt_tokens:
            raise DatasetError(f"{task.dataset}: row {number} renders to {n} prompt tokens, over max_prompt_tokens "
                               f"{spec.max_prompt_tokens} (shorten it, drop it, or raise max_prompt_tokens)")
        report.prompt_tokens.append(n)
    return report


def reference_grades(env: Environment, prompts: list[PromptSpec]) -> list[float | None]:
    """The weighted total each prompt's reference answer earns as a completion (in-process); a
    reasoning job's answer is written in its format (`reasoning_completion`)."""
    answers = [str(p.info.get("answer", "")) for p in prompts]
    if isinstance(env, ReasoningGymEnv):
        answers = [reasoning_completion(env.format, a) for a in answers]
    return [env.total(r) for r in env.rewards(prompts, answers)]


def reasoning_completion(fmt: str, answer: str, thinking: str = " ... ") -> str:
    """A completion that answers `answer` complete in reasoning format `fmt` (the prompt opened
    the thinking span for think_answer)."""
    close = "</think>" if fmt == "think_answer" else ""
    return f"{thinking}{close} <answer>{answer}</answer>"


def token_summary(counts: list[int]) -> str:
    """"min / mean / max" of prompt token counts."""
    if not counts:
        return "-"
    return f"{min(counts)} / {statistics.fmean(counts):.1f} / {max(counts)}"


def grader_for(spec: JobSpec, timeout_s: float) -> Any:
    """The job's grading pool: its installed environment's reward functions, a data-set job's
    built-in rewards (no environment or submitter code loaded), or a reasoning-gym job's scorers."""
    from swarmrl.node.tasks.grading import GradingPool

    task = spec.dataset
    rewards = [r.model_dump(mode="json") for r in task.rewards] if task is not None else None
    rg = spec.reasoning_gym
    table = {"environment": rg.model_dump(mode="json"), "seed": spec.seed} if rg is not None else None
    return GradingPool(spec.environment_id, spec.environment_version, timeout_s=timeout_s, rewards=rewards,
                       task=table)
