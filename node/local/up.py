"""`swarmrl up`: a whole swarm on 127.0.0.1 as separate OS processes, one job, live progress.

Bootstrap -> trainer -> submit the job -> validator + workers -> follow the job (node/local/live.py)
-> fetch the adapter -> write metrics.csv, reward.png, summary.json (node/local/summary.py) -> stop
everything -> held-out accuracy, base vs adapter (node/evaluation/heldout.py). The processes are
started and stopped by `LocalSwarm` (node/local/processes.py); on SIGINT / SIGTERM what the run did
is kept (node/local/interrupt.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console

from swarmrl.node.local.credit_audit import audit_summary, credit_summary
from swarmrl.node.local.endpoints import collect_endpoints, describe, write_endpoints
from swarmrl.node.local.interrupt import (
    RunSoFar,
    Signalled,
    UpInterrupted,
    failed_line,
    interrupted_line,
    keep_what_it_did,
    saving,
    signal_of,
    warm_plotting,
)
from swarmrl.node.local.live import LiveLine, follow
from swarmrl.node.local.netns import swarm_for_up
from swarmrl.node.local.processes import LocalSwarm, SwarmFailed, signal_handler
from swarmrl.node.local.summary import print_summary, red_team_summary, summarize, write_outputs
from swarmrl.node.models.base_model import (
    find_base_model,
    is_builtin_model,
    prepare_base_model,
    resolve_model_name,
)
from swarmrl.node.runtime.config import WorkerConfig
from swarmrl.node.submitter.client import fetch_job_adapter, job_status, sign_job, submit_signed
from swarmrl.node.swarm.figures import base_model_bytes, swarm_figures
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.retention import disk_use
from swarmrl.node.worker.red_team import check_mode
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import MAX_WEIGHT
from swarmrl.protocol.pb import swarm_pb2 as pb

console = Console(stderr=True)   # progress, warnings and where things are; results go to stdout
HELPER_NICE = 5  # workers and the validator run at lower CPU priority than the trainer
VLLM_WORKER_READY_S = 900.0   # a vLLM worker is ready once its server serves (minutes on a loaded CPU)


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
    trainer_red_team: str | None = None   # the first trainer cooks its credit books (node/trainer/red_team.py)
    job_overrides: dict[str, Any] = field(default_factory=dict)   # nested job fields (from -j), over the job
    worker_overrides: list[str] = field(default_factory=list)   # extra `key=value` worker config (e.g. gossip=false)
    job_file: Path | None = None   # JOB.toml as `swarmrl submit` takes it (None: the built-in job on `model`)
    netns: bool = False   # roles on a test bed of network namespaces (node/local/netns.py) instead of loopback
    tls: bool = False     # trainers serve gRPC over TLS (pinned self-signed certificates, node/net/tls.py)
    eval_n: int = 200     # held-out prompts scored, base vs adapter, once the swarm has stopped (0: no eval)


def run_up(opts: UpOptions) -> dict[str, Any]:
    """Run the local swarm to the end of its job, then score the adapter on held-out prompts;
    returns the summary (also written to out/).

    On a failure every role is stopped, and `out` is removed if this call created it and
    nothing was written in it. On SIGINT / SIGTERM the roles are stopped and what the run did is
    kept (node/local/interrupt.py).

    Raises:
        UpInterrupted: after a signal, with the exit code and the line to print.
    """
    created = not opts.out.exists()
    run = RunSoFar(opts.out)
    try:
        with signal_handler(signal.SIGTERM, raise_signalled):   # unwind through stop_all, as on Ctrl-C
            summary = _run_up(opts, run)
            return _headline(summary, opts, run)
    except (KeyboardInterrupt, Signalled) as exc:
        signum = signal_of(exc)   # outside the swarm's block, or a second signal after the saving
        raise UpInterrupted(128 + signum, interrupted_line(signum, run)) from None
    finally:
        if created and opts.out.is_dir() and not any(p.is_file() for p in opts.out.rglob("*")):
            shutil.rmtree(opts.out, ignore_errors=True)


def _run_up(opts: UpOptions, run: RunSoFar) -> dict[str, Any]:
    opts.out.mkdir(parents=True, exist_ok=True)
    work = opts.out / "run"
    shutil.rmtree(work, ignore_errors=True)  # a fresh swarm (keys, ledger, logs) every time
    with console.status("preparing the base model and the job (cached after the first run)"):
        spec, dataset = up_job(opts)
    run.spec, run.dataset = spec, dataset
    with swarm_for_up(work, netns=opts.netns, tls=opts.tls, trainers=opts.trainers) as swarm:
        try:
            return _drive(swarm, spec, opts, work, dataset, run)
        except (KeyboardInterrupt, Signalled) as exc:
            signum = signal_of(exc)
            _stop_and_keep(swarm, run, signal.Signals(signum).name)
            raise UpInterrupted(128 + signum, interrupted_line(signum, run)) from None
        except SwarmFailed as exc:   # a role died, a timeout: keep what the run did, as an interrupt does
            _stop_and_keep(swarm, run, "failure")
            first, _, rest = str(exc).partition("\n")   # the first line is the one a person sees
            raise SwarmFailed(f"{first.rstrip(':')}; {failed_line(run)}\n{rest}") from exc
        finally:
            swarm.stop_all()


def _stop_and_keep(swarm: LocalSwarm, run: RunSoFar, by: str) -> None:
    """Stop the roles and keep what the run did (`keep_what_it_did`; `by`: the signal's name, or
    "failure"); a second signal can't cut this short."""
    with saving():
        warm_plotting()
        swarm.stop_all()
        run.kept = keep_what_it_did(run, by)


def raise_signalled(signum: int, _frame: FrameType | None) -> None:
    """A SIGTERM handler: raise `Signalled`, so the run unwinds as on Ctrl-C."""
    raise Signalled(signum)


def _headline(summary: dict[str, Any], opts: UpOptions, run: RunSoFar) -> dict[str, Any]:
    """Held-out accuracy, greedy, of the base model and of the final adapter, into summary.json
    and as the last line on stdout, a result like the summary table (`--no-eval`: neither). The
    run has trained and kept its outputs by now: an evaluation that fails is one warning and
    `heldout_error` in summary.json, not a failed run."""
    if not opts.eval_n or run.spec is None:
        return summary
    from swarmrl.node.evaluation.heldout import heldout_of_job

    try:
        with console.status(f"held-out evaluation: base vs adapter on {opts.eval_n} prompts (greedy)"):
            base, tuned = heldout_of_job(opts.out / "adapter", run.spec, run.dataset, n=opts.eval_n,
                                         cache_dir=opts.cache_dir)
    except Exception as exc:  # noqa: BLE001 - the training's outputs are kept; the figure is what failed
        summary["heldout_error"] = f"{type(exc).__name__}: {exc}"[:300]
        (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        console.print(f"swarmrl up: warning: the held-out evaluation failed ({summary['heldout_error']}); "
                      f"the run's outputs are kept in {opts.out}", markup=False, highlight=False)
        return summary
    summary.update(heldout_accuracy_base=base.accuracy, heldout_accuracy_adapter=tuned.accuracy, heldout_n=tuned.n)
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    print(f"held-out accuracy, greedy: base {base.accuracy:.3f} -> adapter {tuned.accuracy:.3f} (n={tuned.n})",
          flush=True)
    return summary


def up_job(opts: UpOptions) -> tuple[JobSpec, bytes | None]:
    """The job `up` runs: JOB.toml (checked as at submit time) or the built-in job, with the
    command line's overrides on top."""
    flags = {"steps": opts.steps, "max_async_level": opts.max_async_level}
    over: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    if opts.loss:
        over["loss"] = {"variant": opts.loss}
    if opts.job_file is not None:
        from swarmrl.node.tasks.job_file import load_job_file

        seed = {"seed": opts.seed} if opts.seed else {}
        loaded = load_job_file(opts.job_file, opts.cache_dir, {**seed, **opts.job_overrides, **over},
                               base_model=opts.model)
        for warning in loaded.report.warnings:
            console.print(f"[yellow]warning:[/] {warning}")
        return loaded.spec, loaded.dataset
    model = opts.model or "tiny"
    if is_builtin_model(model):   # a model folder or cached hub id is used as it is
        model = resolve_model_name(model)
        prepare_base_model(model, opts.cache_dir)
    return builtin_job(model, opts.cache_dir, seed=opts.seed, **opts.job_overrides, **over), None


def role_keys(work: Path, names: list[str]) -> dict[str, Identity]:
    """Each role's key (`work/keys/NAME.key`, created on first use), by process name."""
    return {n: Identity.load_or_create(work / "keys" / f"{n}.key") for n in names}


def trainer_names(n: int) -> list[str]:
    """Process names of `n` trainers: "trainer", "trainer1", "trainer2", ..."""
    return ["trainer"] + [f"trainer{i}" for i in range(1, n)]


def _start_trainers(swarm: LocalSwarm, names: list[str], keys: dict[str, Identity], opts: UpOptions, work: Path,
                    common: list[str]) -> list[str]:
    """Start the trainers (each its own prompt shard; cotrainers of each other; the run's own
    submitter may ask any job weight) and return their gRPC endpoints."""
    ids = [keys[n].peer_id for n in names]
    for rank, name in enumerate(names):
        several = [f"prompt_shard={json.dumps([rank, len(names)])}", f"cotrainers={json.dumps(ids)}"]
        swarm.start(name, "trainer", common + [
            f"key={json.dumps(str(work / 'keys' / (name + '.key')))}",
            f"state_dir={json.dumps(str(work / name))}", f"ready_file={json.dumps(str(work / (name + '.ready')))}",
            f"trusted_validators={json.dumps([keys['validator'].peer_id])}", "metrics_port=0",
            f"submitter_weight_caps={json.dumps({keys['submitter'].peer_id: MAX_WEIGHT})}",   # its own job: any weight
            f"threads={opts.threads.get('trainer', 1)}"] + (several if len(names) > 1 else [])
            + ([f"red_team={json.dumps(opts.trainer_red_team)}"] if rank == 0 and opts.trainer_red_team else []),
            threads=opts.threads.get("trainer", 1))
    return [swarm.wait_ready(n, work / f"{n}.ready", timeout_s=300)["endpoint"] for n in names]


def _job_environments(spec: JobSpec) -> list[str]:
    """The worker setting that lets this run's workers play the job's installed environment when
    it is not a built-in one (a worker runs only the environments its config lists; whoever runs
    `swarmrl up JOB.toml` chose this one); [] otherwise."""
    default = WorkerConfig.model_fields["environments"].default
    if spec.carries_task or spec.environment in default:
        return []
    return [f"environments={json.dumps([*default, spec.environment])}"]


def _drive(swarm: LocalSwarm, spec: JobSpec, opts: UpOptions, work: Path,
           dataset: bytes | None, run: RunSoFar) -> dict[str, Any]:
    workers = [f"worker{i}" for i in range(opts.workers)]
    adversaries = {f"redteam-{check_mode(m)}": m for m in opts.red_team}   # one adversarial worker per mode
    trainers = trainer_names(max(1, opts.trainers))
    keys = role_keys(work, ["submitter", *trainers, "validator", *workers, *adversaries])
    run.keys, run.trainer_dir = keys, work / trainers[0]
    cache = [f"cache_dir={json.dumps(str(opts.cache_dir))}"] if opts.cache_dir else []
    runs = _job_environments(spec)
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
            f"threads={opts.threads.get('worker', 1)}", *runs, *opts.worker_overrides],
            threads=opts.threads.get("worker", 1), nice=HELPER_NICE)
    vllm = f"backend={json.dumps('vllm')}" in opts.worker_overrides
    ready_s = VLLM_WORKER_READY_S if vllm else 300
    if vllm and adversaries:   # vLLM servers start slowly: adversaries would have the job to themselves
        with console.status(f"waiting for {len(workers)} vLLM workers to start their servers"):
            for w in workers:
                swarm.wait_ready(w, work / f"{w}.ready", timeout_s=ready_s)
    for a, mode in adversaries.items():
        swarm.start(a, "worker", net + cache + [
            f"key={json.dumps(str(work / 'keys' / (a + '.key')))}", f"base_model={json.dumps(spec.base_model)}",
            f"ready_file={json.dumps(str(work / (a + '.ready')))}", "exit_when_done=true", f"red_team={mode}",
            "threads=1", *runs], threads=1, nice=HELPER_NICE)
    with console.status(f"waiting for {len(workers) + len(adversaries)} workers to load {spec.base_model}"):
        for w in [*workers, *adversaries]:
            swarm.wait_ready(w, work / f"{w}.ready", timeout_s=ready_s)
    with console.status("submitting the job (the trainers load the model)"):
        envelope = sign_job(keys["submitter"], spec, dataset)
        job_ids = {submit_signed(ep, envelope) for ep in endpoints}   # the same signed job: one job id
        job_id = job_ids.pop()
    run.job_id = job_id
    swarm.wait_ready("validator", work / "validator.ready")
    ops = collect_endpoints(work, [*trainers, "validator", *workers, *adversaries], job_id)
    write_endpoints(work, ops)
    console.print(describe(ops))
    t0 = time.monotonic()
    disk = DiskWatch([work / t for t in trainers])
    with LiveLine(console, spec.steps) as live:
        status = follow(swarm, endpoint, job_id, spec, opts.timeout_s, live, watch=["bootstrap", *trainers, "validator"],
                        disk=disk)
        adapter_dir = opts.out / "adapter"
        version, adapter_hash = fetch_job_adapter(endpoint, job_id, adapter_dir, opts.cache_dir)
        workers_state = wait_workers(swarm, [*workers, *adversaries], work)
        adversaries_state = {a: workers_state.pop(a) for a in adversaries}
        status = settle_validator(endpoint, job_id, spec)
        live.finish(status)   # the last line shows the snapshot the summary is written from
    summary = summarize(status, spec, job_id, version, adapter_hash, workers_state, keys, time.monotonic() - t0)
    summary.update(red_team_summary(status, adversaries, adversaries_state, keys, workers))
    summary["disk"] = disk.report()
    summary["audit"] = audit_summary(endpoint, job_id, {w: keys[w] for w in [*workers, *adversaries]}, workers,
                                     opts.cache_dir)
    summary["credit"] = credit_summary(endpoint, job_id, {keys[w].peer_id: w for w in [*workers, *adversaries]})
    if opts.trainer_red_team:
        summary["trainer_red_team"] = opts.trainer_red_team
    statuses = [status] + [job_status(ep, job_id, history=spec.steps) for ep in endpoints[1:]]
    figures = swarm_figures(statuses, workers_state, job_id,
                            base_model_bytes(find_base_model(spec.base_model, opts.cache_dir)))
    summary.update(figures)
    summary["peers"] = sorted({p.peer_id for st in statuses for p in st.peers})
    summary["groups_admitted_by_worker"] = admitted_by_worker(statuses, keys, [*workers, *adversaries])
    summary["worker_cpu_s"] = {w: workers_state.get(w, {}).get("cpu_s") for w in workers}   # honest workers' own CPU
    summary["adapter_hash_agreement"] = summary["adapter_hash_agreement"] and figures["trainers_agree"] and all(
        t["hash"] == adapter_hash.hex() for t in figures["trainer_adapters"].values())
    write_outputs(opts.out, status, summary)
    run.finished = True
    print_summary(summary, opts.out)   # the result, on stdout; progress and logs stay on stderr
    return summary


def admitted_by_worker(statuses: list[pb.JobStatus], keys: dict[str, Identity], workers: list[str]) -> dict[str, int]:
    """Groups each worker (by process name) got admitted, summed over the job's trainers."""
    by_peer: dict[str, int] = {}
    for st in statuses:
        for p in st.peers:
            by_peer[p.peer_id] = by_peer.get(p.peer_id, 0) + int(p.groups_admitted)
    return {w: by_peer.get(keys[w].peer_id, 0) for w in workers}


class DiskWatch:
    """Bytes under the trainers' state folders: sampled while the job runs (peak) and at the end."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders, self.peak = folders, 0

    def sample(self) -> int:
        """Bytes under the trainers' folders now (and raise the peak if it is the most yet)."""
        total = sum(disk_use(f)["total"] for f in self.folders if f.exists())
        self.peak = max(self.peak, total)
        return total

    def report(self) -> dict[str, Any]:
        """{"trainer_bytes": now, "trainer_peak_bytes": the largest sample, "by_trainer": {name: by kind}}."""
        now = self.sample()
        return {"trainer_bytes": now, "trainer_peak_bytes": self.peak,
                "by_trainer": {f.name: disk_use(f) for f in self.folders if f.exists()}}


def settle_validator(endpoint: str, job_id: str, spec: JobSpec, timeout_s: float = 30) -> pb.JobStatus:
    """The final status once the validator has had a chance to check the last batches."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while True:
        st = job_status(endpoint, job_id, history=spec.steps)
        if st.validator_checked == last or time.monotonic() > deadline:
            return st
        last = st.validator_checked
        time.sleep(3.0)


def wait_workers(swarm: LocalSwarm, workers: list[str], work: Path,
                  timeout_s: float = 120) -> dict[str, dict[str, Any]]:
    """Workers exit once the job is done (after catching up to the final version)."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        p = swarm.procs[w]
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            swarm.stop(w)
    states: dict[str, dict[str, Any]] = {}
    for w in workers:
        path = work / f"{w}.ready"
        states[w] = json.loads(path.read_text()) if path.exists() else {}
    return states
