"""`swarmrl env list` and `swarmrl env check JOB.toml` (imported lazily by the CLI)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()


def env_list() -> int:
    """Print the installed environments (name, version, package, hash) and the built-in rewards."""
    from swarmrl.protocol.envs import installed_environments
    from swarmrl.protocol.envs.rewards import REWARDS

    envs = Table("environment", "version", "package", "package sha256", "entry point", title="installed environments")
    for e in installed_environments():
        envs.add_row(e.name, e.version, e.package, e.package_sha256[:16] or "-", e.entry_point)
    console.print(envs)
    rewards = Table("reward", "parameters (default; ... = required)", "range", "what it scores",
                    title="built-in rewards (data-set jobs)")
    for name, kind in sorted(REWARDS.items()):
        params = ", ".join(f"{k}={'...' if v is ... else v!r}" for k, v in kind.params.items()) or "-"
        rewards.add_row(name, params, f"[{kind.value_range[0]:g}, {kind.value_range[1]:g}]", kind.description)
    console.print(rewards)
    _rg_tasks()
    return 0


def _rg_tasks() -> None:
    """The reasoning-gym tasks a job's `[environment] reasoning_gym = NAME` may name, with their
    configuration fields and defaults (docs/REASONING.md)."""
    from swarmrl.protocol.envs.rg_env import RGTaskError, installed_version, task_fields, task_names

    try:
        version = installed_version()
    except RGTaskError as exc:
        console.print(f"reasoning-gym tasks: none ({exc})")
        return
    table = Table("task", "config fields (default)", title=f"reasoning-gym {version} tasks ([environment] reasoning_gym = TASK)")
    for name in task_names():
        fields = ", ".join(f"{k}={'...' if v is ... else v!r}" for k, v in task_fields(name).items())
        table.add_row(name, fields if len(fields) <= 160 else fields[:157] + "...")
    console.print(table)


def env_check(job: Path, model: str | None, cache_dir: Path | None, n: int = 3) -> int:
    """Load the job's task as at submit time, render `n` prompts exactly as workers do, grade the
    reference answers, print token counts and the time taken."""
    from swarmrl.node.models.causal_lm import render_prompt
    from swarmrl.node.tasks.job_file import load_job_file, load_tokenizer, reference_grades, token_summary
    from swarmrl.protocol.envs import job_environment
    from swarmrl.protocol.envs.dataset import DatasetEnv
    from swarmrl.protocol.envs.episode import EpisodeEnv
    from swarmrl.protocol.envs.rg_env import ReasoningGymEnv
    from swarmrl.protocol.episode_limits import episode_limits

    t0 = time.monotonic()
    loaded = load_job_file(job, cache_dir, base_model=model)
    spec, report = loaded.spec, loaded.report
    tok = load_tokenizer(spec.base_model, cache_dir)
    env = job_environment(spec, loaded.dataset)
    prompts = env.prompts(spec.seed, range(n))
    console.print(f"job {spec.name}: task {spec.environment_id} on {spec.base_model} "
                  f"(sha256 {spec.base_model_sha256[:12]}), seed {spec.seed}, chat template {spec.chat_template}")
    if isinstance(env, DatasetEnv):
        task = env.task
        console.print(f"data set {task.dataset}: {report.rows} rows ({report.train_rows} train, "
                      f"{report.heldout_rows} held out), {report.duplicates} duplicates, {task.dataset_size} bytes, "
                      f"sha256 {task.dataset_sha256[:16]}")
        console.print("rewards: " + ", ".join(f"{r.name} x{r.weight:g}" for r in task.rewards)
                      + f"; total in [{env.reward_range[0]:g}, {env.reward_range[1]:g}]")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/] {warning}")
    if isinstance(env, ReasoningGymEnv):
        console.print(f"reasoning-gym {env.version}: {env.task.label}; format {env.format}, stop "
                      f"{list(spec.sampling.stop)}, max_new_tokens {spec.sampling.max_new_tokens}")
    grades = (reference_grades(env, prompts) if isinstance(env, (DatasetEnv, ReasoningGymEnv))
              else [None] * len(prompts))
    for p, grade in zip(prompts, grades, strict=True):
        ids = render_prompt(tok, p, spec.chat_template)
        console.rule(f"prompt {p.index}: {len(ids)} tokens; reference answer {p.info.get('answer')!r} "
                     f"grades {grade if grade is None else round(grade, 4)}")
        console.print(tok.decode(ids), markup=False, highlight=False)
    if isinstance(env, EpisodeEnv):   # multi-turn: one whole episode, environment tokens marked
        from swarmrl.node.evaluation.episodes import check_episode

        limits = episode_limits(spec, env)
        assert limits is not None
        check_episode(console, tok, env, prompts[0], render_prompt(tok, prompts[0], spec.chat_template), limits)
    console.rule()
    console.print(f"prompt tokens min / mean / max over {len(report.prompt_tokens)} rendered prompts: "
                  f"{token_summary(report.prompt_tokens)} (max_prompt_tokens {spec.max_prompt_tokens}); "
                  f"checked in {time.monotonic() - t0:.1f} s")
    return 0
