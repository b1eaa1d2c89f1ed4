"""What a several-job `swarmrl up` reports: each job's figures, each worker's split of its work
between the jobs, the run's summary.json and the two tables it prints.

Each job's own folder (`out/jobs/NAME/`) holds the one-job files (`summary.py`'s summary.json,
metrics.csv, reward.png, adapter/); the run's `out/summary.json` gathers:

    {"base_model": ..., "jobs": {NAME: figures}, "worker_split": {WORKER: {NAME: groups}},
     "trainers": {TRAINER: [NAME, ...]}, "every_job_trained": bool, "seconds": ...}

A worker's groups for a job are the groups the job's trainer admitted from it (every state:
pending, trained, no signal, dropped), as `groups_admitted_by_worker` counts them in one-job runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from swarmrl.protocol.pb import swarm_pb2 as pb

JOB_FIGURES = ("job_id", "trainer", "weight", "steps", "total_steps", "final_version", "reward_first", "reward_last",
               "reward_window", "groups_admitted", "groups_trained", "groups_no_signal", "groups_dropped",
               "adapter_hash", "adapter_hash_agreement", "adapter", "audit", "credit", "seconds")
"""A job's entry in the run's summary.json (`job_figures`)."""


def job_figures(summary: Mapping[str, Any], trainer: str, weight: float, total_steps: int,
                adapter: Path) -> dict[str, Any]:
    """One job's entry of the run's summary: its one-job summary's (`summary.summarize`) steps,
    reward windows, group counts, hashes, credit audit and leaderboard (`credit_audit`), plus the trainer hosting it (process name), its
    weight, its total steps and where its adapter was written."""
    out = {k: summary.get(k) for k in JOB_FIGURES}
    out.update(trainer=trainer, weight=weight, total_steps=total_steps, adapter=str(adapter))
    return out


def worker_split(statuses: Mapping[str, pb.JobStatus], peer_ids: Mapping[str, str]) -> dict[str, dict[str, int]]:
    """Groups each worker got admitted per job: {worker: {job name: groups}}.

    statuses: job name -> the job's final status (its trainer's `PeerInfo` list); peer_ids:
    worker process name -> peer id. A worker that served a job not at all has 0 for it.
    """
    by_job = {name: {p.peer_id: int(p.groups_admitted) for p in st.peers} for name, st in statuses.items()}
    return {w: {name: peers.get(pid, 0) for name, peers in by_job.items()} for w, pid in peer_ids.items()}


def run_summary(base_model: str, jobs: Mapping[str, dict[str, Any]], split: Mapping[str, Mapping[str, int]],
                trainers: Mapping[str, list[str]], seconds: float) -> dict[str, Any]:
    """The run's summary.json (module docstring). every_job_trained: each job reached its total
    steps and trained groups."""
    trained = all(j["steps"] == j["total_steps"] and (j["groups_trained"] or 0) > 0 for j in jobs.values())
    return {"base_model": base_model, "jobs": dict(jobs), "worker_split": {w: dict(s) for w, s in split.items()},
            "trainers": dict(trainers), "every_job_trained": trained, "seconds": round(seconds, 1)}


def _f(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _audit(a: Mapping[str, Any] | None) -> str:
    if not a:
        return "-"
    if "error" in a:
        return "failed"
    return f"{a['findings']} ({a['statements']} statements)" + (f" {a['by_reason']}" if a["findings"] else "")


def jobs_table(summary: Mapping[str, Any]) -> Table:
    """One row per job: trainer, weight, steps, reward (mean of the first and last windows),
    groups admitted and trained, whether every replica's adapter hash agreed, and the credit
    audit's findings; the adapters' folders in the caption (each job's is in summary.json)."""
    table = Table(title="swarmrl up: jobs", caption="reward: mean over the first -> last (N) steps; "
                  "adapters: out/jobs/JOB/adapter")
    for col in ("job", "job id", "trainer", "weight", "steps", "reward", "admitted", "trained", "hashes agree",
                "audit findings"):
        table.add_column(col, overflow="fold")
    for name, j in summary["jobs"].items():
        table.add_row(name, str(j["job_id"])[:12], j["trainer"], f"{j['weight']:g}", f"{j['steps']}/{j['total_steps']}",
                      f"{_f(j['reward_first'])} -> {_f(j['reward_last'])} ({j['reward_window']})",
                      str(j["groups_admitted"]), str(j["groups_trained"]), str(j["adapter_hash_agreement"]),
                      _audit(j.get("audit")))
    return table


def split_table(summary: Mapping[str, Any]) -> Table:
    """One row per worker: groups admitted per job, its total and how many jobs it served."""
    names = list(summary["jobs"])
    table = Table(title="swarmrl up: each worker's groups admitted, by job")
    for col in ("worker", *names, "total", "jobs served"):
        table.add_column(col)
    for w, split in summary["worker_split"].items():
        counts = [split.get(n, 0) for n in names]
        table.add_row(w, *map(str, counts), str(sum(counts)), str(sum(1 for c in counts if c)))
    return table


def print_run_summary(summary: Mapping[str, Any], out: Path, console: Console | None = None) -> None:
    """Print the jobs and the worker split, to stdout unless `console` says otherwise (progress
    and logs go to stderr, as in the one-job `up`)."""
    c = console or Console()
    c.print(jobs_table(summary))
    c.print(split_table(summary))
    c.print(f"every job trained: {summary['every_job_trained']}; {summary['seconds']} s; outputs: {out}/summary.json, "
            f"{out}/jobs/NAME/ (adapter, metrics.csv, reward.png, summary.json)", markup=False, highlight=False)
