"""`swarmrl up`: a whole swarm on 127.0.0.1 as separate OS processes, one job, live progress.

Bootstrap -> trainer -> submit the job -> validator + workers -> follow the job -> fetch the
adapter -> write metrics.csv, reward.png, summary.json -> stop everything.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from swarmrl.node.endpoints import collect_endpoints, describe, write_endpoints
from swarmrl.node.jobs import builtin_job
from swarmrl.node.models import find_base_model, prepare_base_model, resolve_model_name
from swarmrl.node.runtime import DIE_WITH_PARENT
from swarmrl.node.submitter import fetch_job_adapter, job_status, sign_job, submit_signed
from swarmrl.node.swarm.figures import base_model_bytes, swarm_figures
from swarmrl.node.trainer.retention import disk_use
from swarmrl.node.worker.red_team import check_mode
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

console = Console(stderr=True)
HELPER_NICE = 5  # workers and the validator run at lower CPU priority than the trainer
METRIC_COLUMNS = ("step", "policy_version", "reward_mean", "groups_trained", "groups_rejected", "staleness_mean",
                  "loss", "seconds")


@dataclass
class UpOptions:
    """Everything `swarmrl up` takes from the command line."""

    out: Path
    model: str | None = "tiny"   # None with a job file: the file's base_model
    steps: int | None = None
    workers: int = 2
    trainers: int = 1
    loss: str | None = None
    max_async_level: int | None = None
    seed: int = 0
    cache_dir: Path | None = None
    threads: dict[str, int] = field(default_factory=dict)
    timeout_s: float = 3600.0
    red_team: list[str] = field(default_factory=list)
    job_overrides: dict = field(default_factory=dict)
    worker_overrides: list[str] = field(default_factory=list)   # extra `key=value` worker config (e.g. gossip=false)
    job_file: Path | None = None   # JOB.toml as `swarmrl submit` takes it (None: the built-in job on `model`)


STOP_S = 15.0
"""Seconds the roles get to exit after SIGTERM before their process groups are killed."""


class SwarmFailed(RuntimeError):
    """A process of the local swarm died or the job did not finish in time."""


class LocalSwarm:
    """The child processes of one local swarm, with their logs under `work/logs`."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, subprocess.Popen] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, role: str, overrides: list[str], threads: int = 1, nice: int = 0) -> None:
        """Start `swarmrl <role>` with config overrides; `nice` lowers its CPU priority (the
        trainer is the bottleneck on a shared CPU: workers and validators yield to it)."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", DIE_WITH_PARENT: str(os.getpid())}
        args = [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "swarmrl.node.cli", role]
        for o in overrides:
            args += ["-o", o]
        with open(self.work / "logs" / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                start_new_session=True)

    def check_alive(self, names: list[str] | None = None) -> None:
        for name in names or list(self.procs):
            p = self.procs[name]
            if p.poll() is not None:
                raise SwarmFailed(f"{name} exited with code {p.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        text = (self.work / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, name: str, path: Path, timeout_s: float = 180) -> dict:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            self.check_alive([name])
            if time.monotonic() > deadline:
                raise SwarmFailed(f"{name} not ready after {timeout_s:.0f}s:\n{self.tail(name)}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def stop(self, name: str, timeout_s: float = STOP_S) -> int | None:
        """SIGTERM one role; after `timeout_s`, or once it exits, kill what is left of its
        process group (each role runs in its own session)."""
        return self._stop([name], timeout_s)[name]

    def stop_all(self, timeout_s: float = STOP_S) -> None:
        """Stop every role at once (each exits within ~10 s of SIGTERM); a second Ctrl-C can't
        interrupt this and leave processes behind."""
        with _signal_handler(signal.SIGINT, signal.SIG_IGN):
            self._stop(list(self.procs), timeout_s)

    def _stop(self, names: list[str], timeout_s: float) -> dict[str, int | None]:
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            p = self.procs[name]
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)   # the role if it hangs, and any straggler of its group
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        return {n: self.procs[n].returncode for n in names}


def run_up(opts: UpOptions) -> dict:
    """Run the local swarm to the end of its job; returns the summary (also written to out/).
    On failure or Ctrl-C every role is stopped, and `out` is removed if this call created it
    and nothing was written in it."""
    created = not opts.out.exists()
    try:
        with _signal_handler(signal.SIGTERM, _exit_on_sigterm):   # unwind through stop_all, as on Ctrl-C
            return _run_up(opts)
    except BaseException:
        if created and opts.out.is_dir() and not any(p.is_file() for p in opts.out.rglob("*")):
            shutil.rmtree(opts.out, ignore_errors=True)
        raise


def _run_up(opts: UpOptions) -> dict:
    opts.out.mkdir(parents=True, exist_ok=True)
    work = opts.out / "run"
    shutil.rmtree(work, ignore_errors=True)  # a fresh swarm (keys, ledger, logs) every time
    with console.status("preparing the base model and the job (cached after the first run)"):
        spec, dataset = _up_job(opts)
    swarm = LocalSwarm(work)
    try:
        return _drive(swarm, spec, opts, work, dataset)
    finally:
        swarm.stop_all()


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signal_handler(sig: int, handler):
    """Install `handler` for `sig` while the block runs (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(sig, previous)


def _up_job(opts: UpOptions) -> tuple[JobSpec, bytes | None]:
    """The job `up` runs: JOB.toml (checked as at submit time) or the built-in job, with the
    command line's overrides on top."""
    over = {k: v for k, v in {"steps": opts.steps, "max_async_level": opts.max_async_level}.items() if v is not None}
    if opts.loss:
        over["loss"] = {"variant": opts.loss}
    if opts.job_file is not None:
        from swarmrl.node.tasks import load_job_file

        seed = {"seed": opts.seed} if opts.seed else {}
        loaded = load_job_file(opts.job_file, opts.cache_dir, {**seed, **opts.job_overrides, **over},
                               base_model=opts.model)
        for warning in loaded.report.warnings:
            console.print(f"[yellow]warning:[/] {warning}")
        return loaded.spec, loaded.dataset
    model = resolve_model_name(opts.model or "tiny")
    prepare_base_model(model, opts.cache_dir)
    return builtin_job(model, opts.cache_dir, seed=opts.seed, **opts.job_overrides, **over), None


def _keys(work: Path, names: list[str]) -> dict[str, Identity]:
    return {n: Identity.load_or_create(work / "keys" / f"{n}.key") for n in names}


def trainer_names(n: int) -> list[str]:
    """Process names of `n` trainers: "trainer", "trainer1", "trainer2", ..."""
    return ["trainer"] + [f"trainer{i}" for i in range(1, n)]


def _start_trainers(swarm: LocalSwarm, names: list[str], keys: dict[str, Identity], opts: UpOptions, work: Path,
                    common: list[str]) -> list[str]:
    """Start the trainers (each its own prompt shard; cotrainers of each other) and return their
    gRPC endpoints."""
    ids = [keys[n].peer_id for n in names]
    for rank, name in enumerate(names):
        several = [f"prompt_shard={json.dumps([rank, len(names)])}", f"cotrainers={json.dumps(ids)}"]
        swarm.start(name, "trainer", common + [
            f"key={json.dumps(str(work / 'keys' / (name + '.key')))}",
            f"state_dir={json.dumps(str(work / name))}", f"ready_file={json.dumps(str(work / (name + '.ready')))}",
            f"trusted_validators={json.dumps([keys['validator'].peer_id])}", "metrics_port=0",
            f"threads={opts.threads.get('trainer', 1)}"] + (several if len(names) > 1 else []),
            threads=opts.threads.get("trainer", 1))
    return [swarm.wait_ready(n, work / f"{n}.ready", timeout_s=300)["endpoint"] for n in names]


def _drive(swarm: LocalSwarm, spec: JobSpec, opts: UpOptions, work: Path, dataset: bytes | None = None) -> dict:
    workers = [f"worker{i}" for i in range(opts.workers)]
    adversaries = {f"redteam-{check_mode(m)}": m for m in opts.red_team}   # one adversarial worker per mode
    trainers = trainer_names(max(1, opts.trainers))
    keys = _keys(work, ["submitter", *trainers, "validator", *workers, *adversaries])
    cache = [f"cache_dir={json.dumps(str(opts.cache_dir))}"] if opts.cache_dir else []
    swarm.start("bootstrap", "bootstrap", [f"ready_file={json.dumps(str(work / 'bootstrap.ready'))}"])
    peers = swarm.wait_ready("bootstrap", work / "bootstrap.ready")["maddrs"]
    net = [f"net.initial_peers={json.dumps(peers)}"]
    endpoints = _start_trainers(swarm, trainers, keys, opts, work, net + cache)
    endpoint = endpoints[0]
    swarm.start("validator", "validator", net + cache + [
        f"key={json.dumps(str(work / 'keys/validator.key'))}", f"state_dir={json.dumps(str(work / 'validator'))}",
        f"ready_file={json.dumps(str(work / 'validator.ready'))}", "metrics_port=0",
        f"threads={opts.threads.get('validator', 1)}"], threads=opts.threads.get("validator", 1), nice=HELPER_NICE)
    for i, w in enumerate(workers):
        prefer = [f"prefer_trainer={json.dumps(keys[trainers[i % len(trainers)]].peer_id)}"] if len(trainers) > 1 else []
        swarm.start(w, "worker", net + cache + prefer + [
            f"key={json.dumps(str(work / 'keys' / (w + '.key')))}", f"base_model={json.dumps(spec.base_model)}",
            f"ready_file={json.dumps(str(work / (w + '.ready')))}", "exit_when_done=true", "metrics_port=0",
            f"threads={opts.threads.get('worker', 1)}", *opts.worker_overrides],
            threads=opts.threads.get("worker", 1), nice=HELPER_NICE)
    for a, mode in adversaries.items():
        swarm.start(a, "worker", net + cache + [
            f"key={json.dumps(str(work / 'keys' / (a + '.key')))}", f"base_model={json.dumps(spec.base_model)}",
            f"ready_file={json.dumps(str(work / (a + '.ready')))}", "exit_when_done=true", f"red_team={mode}",
            "threads=1"], threads=1, nice=HELPER_NICE)
    with console.status(f"waiting for {len(workers) + len(adversaries)} workers to load {spec.base_model}"):
        for w in [*workers, *adversaries]:
            swarm.wait_ready(w, work / f"{w}.ready", timeout_s=300)
    with console.status("submitting the job (the trainers load the model)"):
        envelope = sign_job(keys["submitter"], spec, dataset)
        job_ids = {submit_signed(ep, envelope) for ep in endpoints}   # the same signed job: one job id
        job_id = job_ids.pop()
    swarm.wait_ready("validator", work / "validator.ready")
    ops = collect_endpoints(work, [*trainers, "validator", *workers, *adversaries], job_id)
    write_endpoints(work, ops)
    console.print(describe(ops))
    t0 = time.monotonic()
    disk = DiskWatch([work / t for t in trainers])
    status = _follow(swarm, endpoint, job_id, spec, opts.timeout_s, watch=["bootstrap", *trainers, "validator"],
                     disk=disk)
    adapter_dir = opts.out / "adapter"
    version, adapter_hash = fetch_job_adapter(endpoint, job_id, adapter_dir, opts.cache_dir)
    workers_state = _wait_workers(swarm, [*workers, *adversaries], work)
    adversaries_state = {a: workers_state.pop(a) for a in adversaries}
    status = _settle_validator(endpoint, job_id, spec)
    summary = _summarize(status, spec, job_id, version, adapter_hash, workers_state, keys, time.monotonic() - t0)
    summary.update(red_team_summary(status, adversaries, adversaries_state, keys, workers))
    summary["disk"] = disk.report()
    statuses = [status] + [job_status(ep, job_id, history=spec.steps) for ep in endpoints[1:]]
    figures = swarm_figures(statuses, workers_state, job_id,
                            base_model_bytes(find_base_model(spec.base_model, opts.cache_dir)))
    summary.update(figures)
    summary["peers"] = sorted({p.peer_id for st in statuses for p in st.peers})
    summary["adapter_hash_agreement"] = summary["adapter_hash_agreement"] and figures["trainers_agree"] and all(
        t["hash"] == adapter_hash.hex() for t in figures["trainer_adapters"].values())
    _write_outputs(opts.out, status, summary)
    _print_summary(summary, opts.out)
    return summary


class DiskWatch:
    """Bytes under the trainers' state folders: sampled while the job runs (peak) and at the end."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders, self.peak = folders, 0

    def sample(self) -> int:
        total = sum(disk_use(f)["total"] for f in self.folders if f.exists())
        self.peak = max(self.peak, total)
        return total

    def report(self) -> dict:
        """{"trainer_bytes": now, "trainer_peak_bytes": the largest sample, "by_trainer": {name: by kind}}."""
        now = self.sample()
        return {"trainer_bytes": now, "trainer_peak_bytes": self.peak,
                "by_trainer": {f.name: disk_use(f) for f in self.folders if f.exists()}}


def _follow(swarm: LocalSwarm, endpoint: str, job_id: str, spec: JobSpec, timeout_s: float,
            watch: list[str] | None = None, disk: DiskWatch | None = None) -> pb.JobStatus:
    """Show live progress until the job is done; returns the final status (full history).
    The status line wraps rather than being cut at the terminal's width."""
    columns = [TextColumn("[bold]training"), BarColumn(bar_width=16), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[info]}", table_column=Column(ratio=1, no_wrap=False, overflow="fold"))]
    deadline = time.monotonic() + timeout_s
    with Progress(*columns, console=console, transient=False, expand=True) as progress:
        task = progress.add_task("steps", total=spec.steps, info="waiting for rollouts")
        while True:
            swarm.check_alive(watch or ["bootstrap", "trainer", "validator"])
            st = job_status(endpoint, job_id, history=1)
            progress.update(task, completed=st.step, info=_progress_info(st))
            if disk is not None:
                disk.sample()
            if st.state == "done":
                return job_status(endpoint, job_id, history=spec.steps)
            if time.monotonic() > deadline:
                raise SwarmFailed(f"job not done after {timeout_s:.0f}s (step {st.step}/{st.total_steps})")
            time.sleep(0.5)


def _progress_info(st: pb.JobStatus) -> str:
    """The live status line: the reward and staleness are the last step's (summary.json's
    `reward_last` is a mean over the last `reward_window` steps)."""
    rejected = sum(st.groups_rejected.values())
    last = st.history[-1] if st.history else None
    reward = f"{last.reward_mean:.3f}" if last and not math.isnan(last.reward_mean) else "-"
    stale = f"{last.staleness_mean:.2f}" if last else "-"
    return (f"v{st.policy_version}  last step: reward {reward}, staleness {stale}  groups: {st.groups_admitted} "
            f"admitted, {rejected} rejected, {st.validator_checked} checked"
            + (f", {st.groups_on_probation} on probation" if st.groups_on_probation else ""))


def _settle_validator(endpoint: str, job_id: str, spec: JobSpec, timeout_s: float = 30) -> pb.JobStatus:
    """The final status once the validator has had a chance to check the last batches."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        st = job_status(endpoint, job_id, history=spec.steps)
        if st.validator_checked == last or time.monotonic() > deadline:
            return st
        last = st.validator_checked
        time.sleep(3.0)


def _wait_workers(swarm: LocalSwarm, workers: list[str], work: Path, timeout_s: float = 120) -> dict[str, dict]:
    """Workers exit once the job is done (after catching up to the final version)."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        p = swarm.procs[w]
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            swarm.stop(w)
    states = {}
    for w in workers:
        path = work / f"{w}.ready"
        states[w] = json.loads(path.read_text()) if path.exists() else {}
    return states


def _summarize(st: pb.JobStatus, spec: JobSpec, job_id: str, version: int, adapter_hash: bytes,
               workers: dict[str, dict], keys: dict[str, Identity], seconds: float) -> dict:
    """The job's part of summary.json.

    reward_first / reward_last: mean of the per-step mean rewards over the first / last
    `reward_window` steps (5 from 20 steps on, fewer in shorter runs); reward_last_step: the last
    step's alone (what the live status line shows). groups_admitted: every admitted group,
    pending, dropped (stale, banned) and trained alike. The other parts: `red_team_summary`,
    `swarm_figures` (node/swarm/figures.py) and `disk` (`DiskWatch.report`).
    """
    rewards = [h.reward_mean for h in st.history if not math.isnan(h.reward_mean)]
    k = max(1, min(5, len(rewards) // 4 or 1))
    worker_hashes = {w: s.get("adapters", {}).get(job_id, {}) for w, s in workers.items()}
    agree = all(h.get("hash") == adapter_hash.hex() and h.get("version") == version for h in worker_hashes.values())
    return {
        "job_id": job_id, "base_model": spec.base_model, "environment": spec.environment_id, "loss": spec.loss.variant,
        "final_version": int(st.policy_version), "steps": int(st.step),
        "reward_first": sum(rewards[:k]) / k if rewards else math.nan,
        "reward_last": sum(rewards[-k:]) / k if rewards else math.nan,
        "reward_last_step": rewards[-1] if rewards else math.nan,
        "reward_window": k,
        "groups_admitted": int(st.groups_admitted), "groups_dropped": int(st.groups_dropped),
        "groups_rejected": dict(st.groups_rejected),
        "validator": {"checked": int(st.validator_checked), "failed": int(st.validator_failed)},
        "serving_workers": int(st.serving_workers) if st.HasField("serving_workers") else None,
        "peers": [p.peer_id for p in st.peers],
        "roles": {name: ident.peer_id for name, ident in keys.items()},
        "adapter_hash": adapter_hash.hex(), "adapter_hash_agreement": agree,
        "worker_adapters": worker_hashes, "seconds": round(seconds, 1),
        "staleness_mean": sum(h.staleness_mean for h in st.history) / max(1, len(st.history)),
    }


BENIGN_REJECTIONS = frozenset({"stale", "lease_expired", "duplicate_group", "banned", "future_version",
                               "unknown_lease", "unknown_job"})
"""Rejections an honest worker can earn (slow, late, raced): they don't count as detection."""


def red_team_summary(st: pb.JobStatus, adversaries: dict[str, str], states: dict[str, dict],
                     keys: dict[str, Identity], honest: list[str]) -> dict:
    """The drill's figures: per mode {submitted, admitted_before_ban, detected, seconds_to_ban, ...};
    honest workers banned; groups dropped because of bans.

    submitted: groups the adversary sent (its own count). admitted_before_ban: its groups the
    trainer admitted (nothing is admitted after a ban). detected: banned, or a failed verdict, or a
    rejection an honest worker can't earn (not in BENIGN_REJECTIONS). seconds_to_ban: the
    trainer's ban time minus the adversary's first submission (None: not banned).
    """
    peers = {p.peer_id: p for p in st.peers}
    table = {}
    for name, mode in adversaries.items():
        p = peers.get(keys[name].peer_id)
        red = states.get(name, {}).get("red_team", {})
        first = red.get("first_submit_ms") or (p.first_seen_ms if p is not None else 0)
        cheats = {r: n for r, n in (p.rejected_by_reason.items() if p is not None else []) if r not in BENIGN_REJECTIONS}
        banned = p is not None and p.banned
        table[mode] = {
            "submitted": int(red.get("submitted_groups", 0)),
            "admitted_before_ban": int(p.groups_admitted) if p is not None else 0,
            "trained": int(p.groups_trained) if p is not None else 0,
            "detected": bool(banned or (p is not None and p.verdicts_failed > 0) or cheats),
            "banned": bool(banned), "ban_reason": p.ban_reason if p is not None else "",
            "seconds_to_ban": round((p.banned_at_ms - first) / 1000, 1) if banned and first else None,
            "rejected": cheats, "verdicts_failed": int(p.verdicts_failed) if p is not None else 0,
        }
    honest_ids = {keys[w].peer_id for w in honest}
    return {"red_team": table, "honest_banned": sum(1 for p in st.peers if p.peer_id in honest_ids and p.banned),
            "groups_dropped_banned": int(st.groups_dropped_banned)}


def _write_outputs(out: Path, st: pb.JobStatus, summary: dict) -> None:
    extra_keys = sorted({k for h in st.history for k in h.extra})
    with open(out / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*METRIC_COLUMNS, *extra_keys])
        for h in st.history:
            w.writerow([getattr(h, c) for c in METRIC_COLUMNS] + [h.extra.get(k, "") for k in extra_keys])
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    _plot_reward(out / "reward.png", st)


def _plot_reward(path: Path, st: pb.JobStatus) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in st.history]
    rewards = [h.reward_mean for h in st.history]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, rewards, marker=".", label="mean reward of the step's batch")
    if len(rewards) >= 5:
        w = 5
        smooth = [sum(rewards[max(0, i - w + 1):i + 1]) / len(rewards[max(0, i - w + 1):i + 1])
                  for i in range(len(rewards))]
        ax.plot(steps, smooth, label=f"moving mean ({w} steps)")
    ax.set_xlabel("trainer step (policy version)")
    ax.set_ylabel("reward")
    ax.set_title(f"swarmrl job {st.job_id[:12]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_summary(summary: dict, out: Path) -> None:
    table = Table(title="swarmrl up: summary")
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    for key in ("job_id", "base_model", "environment", "loss", "final_version", "steps", "reward_first", "reward_last",
                "reward_last_step", "groups_admitted", "groups_dropped", "groups_rejected", "validator",
                "adapter_hash_agreement", "trainers", "delta_bytes_per_version", "adapter_bytes", "base_model_bytes",
                "trainer_upload_bytes", "peer_upload_bytes", "trainer_upload_share", "trainer_upload_vs_star",
                "seconds"):
        v = summary.get(key)
        window = {"reward_first": "first", "reward_last": "last"}.get(key)
        label = f"{key} (mean, {window} {summary['reward_window']})" if window else key
        table.add_row(label, f"{v:.3f}" if isinstance(v, float) else str(v))
    if "disk" in summary:
        d = summary["disk"]
        table.add_row("trainer disk", f"{d['trainer_bytes'] / 1e6:.2f} MB at the end, "
                      f"{d['trainer_peak_bytes'] / 1e6:.2f} MB at most")
    table.add_row("peers", str(len(summary["peers"])))
    if summary.get("red_team"):
        table.add_row("honest_banned", str(summary["honest_banned"]))
        table.add_row("groups_dropped_banned", str(summary["groups_dropped_banned"]))
        for mode, r in summary["red_team"].items():
            table.add_row(f"red_team {mode}", f"detected={r['detected']} banned={r['banned']} "
                          f"submitted={r['submitted']} admitted={r['admitted_before_ban']} "
                          f"seconds_to_ban={r['seconds_to_ban']}")
    table.add_row("outputs", f"{out}/adapter, metrics.csv, reward.png, summary.json")
    console.print(table)
