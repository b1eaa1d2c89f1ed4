"""`swarmrl up A.toml B.toml ...` / `swarmrl up --jobs N`: one local swarm training several jobs
on one base model at once, as separate OS processes on 127.0.0.1.

Bootstrap -> the trainers (job i on trainer i mod T, node/local/jobs_plan.py; they are not
cotrainers: each job has one trainer, a trainer may host several jobs) -> one validator -> the
workers, shared by every job: each picks among the jobs by their signed demand (the market rule,
protocol/market.py, docs/MARKET.md) -> submit every job -> follow them all -> fetch each adapter
-> each job's files in `out/jobs/NAME/` (as a one-job run writes them in `out/`) and the run's
summary (node/local/many_summary.py) -> stop everything -> held-out accuracy per job. On SIGINT /
SIGTERM, or when a role dies, every submitted job's run so far is kept in its folder
(node/local/interrupt.py), as the one-job `up` keeps its one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from swarmrl.node.local.credit_audit import audit_summary, credit_summary
from swarmrl.node.local.endpoints import collect_endpoints
from swarmrl.node.local.interrupt import (
    RunSoFar,
    Signalled,
    UpInterrupted,
    keep_what_it_did,
    saving,
    signal_of,
    warm_plotting,
)
from swarmrl.node.local.jobs_plan import JobSource
from swarmrl.node.local.live import STATUS_ERRORS_IN_A_ROW, progress_info
from swarmrl.node.local.many_summary import job_figures, print_run_summary, run_summary, worker_split
from swarmrl.node.local.netns import swarm_for_up
from swarmrl.node.local.processes import LocalSwarm, SwarmFailed, signal_handler
from swarmrl.node.local.summary import summarize, write_outputs
from swarmrl.node.local.up import (
    HELPER_NICE,
    DiskWatch,
    UpOptions,
    admitted_by_worker,
    console,
    raise_signalled,
    role_keys,
    settle_validator,
    trainer_names,
    up_job,
    wait_workers,
)
from swarmrl.node.runtime.config import WorkerConfig
from swarmrl.node.runtime.lifecycle import write_ready
from swarmrl.node.submitter.client import fetch_job_adapter, job_status, sign_job, submit_signed
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import MAX_WEIGHT
from swarmrl.protocol.pb import swarm_pb2 as pb


@dataclass
class UpJob:
    """One job of the run: its source, its spec and data set, and (once submitted) its trainer's
    process name and endpoint and its id; `run` is what an interrupt keeps of it."""

    source: JobSource
    spec: JobSpec
    dataset: bytes | None
    run: RunSoFar
    trainer: str = ""
    endpoint: str = ""

    @property
    def name(self) -> str:
        """The job's folder name under `out/jobs/`."""
        return self.source.name


def run_up_many(opts: UpOptions, sources: list[JobSource]) -> dict[str, Any]:
    """Run the local swarm until every job of `sources` is done, then score each adapter on
    held-out prompts; returns the run's summary (also written to out/summary.json).

    Raises:
        ValueError: the jobs name different base models, or two are the same job (exit 2).
        UpInterrupted: after a signal, with the exit code and the line to print.
        SwarmFailed: a role died or the jobs did not finish in time (what they did is kept).
    """
    created = not opts.out.exists()
    jobs: list[UpJob] = []
    try:
        with signal_handler(signal.SIGTERM, raise_signalled):
            summary = _run(opts, sources, jobs)
            return _heldout(summary, opts, jobs)
    except (KeyboardInterrupt, Signalled) as exc:
        signum = signal_of(exc)
        raise UpInterrupted(128 + signum, _interrupted_line(signum, jobs)) from None
    finally:
        if created and opts.out.is_dir() and not any(p.is_file() for p in opts.out.rglob("*")):
            shutil.rmtree(opts.out, ignore_errors=True)


def _run(opts: UpOptions, sources: list[JobSource], jobs: list[UpJob]) -> dict[str, Any]:
    model = one_base_model(opts, sources)
    opts.out.mkdir(parents=True, exist_ok=True)
    work = opts.out / "run"
    shutil.rmtree(work, ignore_errors=True)   # a fresh swarm (keys, ledger, logs) every time
    with console.status(f"preparing the base model and {len(sources)} jobs (cached after the first run)"):
        jobs += prepare_jobs(opts, sources, model)
    with swarm_for_up(work, netns=opts.netns, tls=opts.tls) as swarm:
        try:
            return _drive(swarm, jobs, opts, work)
        except (KeyboardInterrupt, Signalled) as exc:
            signum = signal_of(exc)
            _stop_and_keep(swarm, jobs, signal.Signals(signum).name)
            raise UpInterrupted(128 + signum, _interrupted_line(signum, jobs)) from None
        except SwarmFailed as exc:
            _stop_and_keep(swarm, jobs, "failure")
            first, _, rest = str(exc).partition("\n")
            raise SwarmFailed(f"{first.rstrip(':')}; {_kept_line(jobs)}\n{rest}") from exc
        finally:
            swarm.stop_all()


def one_base_model(opts: UpOptions, sources: list[JobSource]) -> str:
    """The base model every job runs on: --model, else the job files' `base_model` (default
    tiny), which must agree; copies of the built-in job take it too (gemma when nothing names one).

    Raises:
        ValueError: two job files name different base models.
    """
    from swarmrl.node.models.base_model import is_builtin_model, resolve_model_name

    def canonical(name: str) -> str:
        return resolve_model_name(name) if is_builtin_model(name) else name

    if opts.model is not None:
        return canonical(opts.model)
    named = {s.file: canonical(str(tomllib.loads(s.file.read_text()).get("base_model", "tiny")))
             for s in sources if s.file is not None}
    if len(set(named.values())) > 1:
        listed = ", ".join(f"{f}: {m}" for f, m in named.items())
        raise ValueError(f"the job files name different base models ({listed}); one swarm's jobs share one base "
                         "model (give --model to run them all on one)")
    return next(iter(named.values()), canonical("gemma"))


def prepare_jobs(opts: UpOptions, sources: list[JobSource], model: str) -> list[UpJob]:
    """Each job's spec and data set, built as the one-job `up` builds its one (`up.up_job`), on
    `model`, with the copy's seed and the job's weight.

    Raises:
        ValueError: a job refused at submit time, or two jobs with the same spec (the same job id).
    """
    jobs: list[UpJob] = []
    for s in sources:
        over = {**opts.job_overrides, **({"weight": s.weight} if s.weight is not None else {})}
        one = dataclasses.replace(opts, model=model, job_file=s.file, seed=opts.seed + s.seed_offset, job_overrides=over)
        spec, dataset = up_job(one)
        for other in jobs:
            if other.spec == spec and other.dataset == dataset:
                raise ValueError(f"duplicate job: {other.name} and {s.name} are the same job (same spec, so the same "
                                 "job id); give each job once, or copies with --jobs (each its own seed)")
        out = opts.out / "jobs" / s.name
        jobs.append(UpJob(s, spec, dataset, RunSoFar(out, spec=spec, dataset=dataset)))
    return jobs


def worker_environments(specs: list[JobSpec]) -> list[str]:
    """The worker setting that lets this run's workers play every job's installed environment
    that is not a built-in one (as `up._job_environments` for one job); [] when all are."""
    default = list(WorkerConfig.model_fields["environments"].default)
    extra = sorted({s.environment for s in specs
                    if isinstance(s.environment, str) and not s.carries_task and s.environment not in default})
    return [f"environments={json.dumps([*default, *extra])}"] if extra else []


def _drive(swarm: LocalSwarm, jobs: list[UpJob], opts: UpOptions, work: Path) -> dict[str, Any]:
    workers = [f"worker{i}" for i in range(opts.workers)]
    trainers = trainer_names(opts.trainers)
    keys = role_keys(work, ["submitter", *trainers, "validator", *workers])
    cache = [f"cache_dir={json.dumps(str(opts.cache_dir))}"] if opts.cache_dir else []
    swarm.start("bootstrap", "bootstrap", [f"ready_file={json.dumps(str(work / 'bootstrap.ready'))}"])
    peers = swarm.wait_ready("bootstrap", work / "bootstrap.ready")["maddrs"]
    net = [f"net.initial_peers={json.dumps(peers)}"]
    for t in trainers:
        swarm.start(t, "trainer", net + cache + [
            f"key={json.dumps(str(work / 'keys' / (t + '.key')))}", f"state_dir={json.dumps(str(work / t))}",
            f"ready_file={json.dumps(str(work / (t + '.ready')))}", "metrics_port=0",
            f"trusted_validators={json.dumps([keys['validator'].peer_id])}",
            f"submitter_weight_caps={json.dumps({keys['submitter'].peer_id: MAX_WEIGHT})}",   # its own jobs: any weight
            f"threads={opts.threads.get('trainer', 1)}"], threads=opts.threads.get("trainer", 1))
    endpoints = {t: swarm.wait_ready(t, work / f"{t}.ready", timeout_s=300)["endpoint"] for t in trainers}
    swarm.start("validator", "validator", net + cache + [
        f"key={json.dumps(str(work / 'keys/validator.key'))}", f"state_dir={json.dumps(str(work / 'validator'))}",
        f"ready_file={json.dumps(str(work / 'validator.ready'))}", "metrics_port=0",
        f"threads={opts.threads.get('validator', 1)}"], threads=opts.threads.get("validator", 1), nice=HELPER_NICE)
    base = jobs[0].spec.base_model
    for w in workers:   # no preferred trainer: the market spreads them over the jobs
        swarm.start(w, "worker", net + cache + [
            f"key={json.dumps(str(work / 'keys' / (w + '.key')))}", f"base_model={json.dumps(base)}",
            f"ready_file={json.dumps(str(work / (w + '.ready')))}", "exit_when_done=true", f"exit_after_jobs={len(jobs)}",
            "metrics_port=0", f"threads={opts.threads.get('worker', 1)}", *worker_environments([j.spec for j in jobs]),
            *opts.worker_overrides], threads=opts.threads.get("worker", 1), nice=HELPER_NICE)
    vllm = f"backend={json.dumps('vllm')}" in opts.worker_overrides
    with console.status(f"waiting for {len(workers)} workers to load {base}"):
        for w in workers:
            swarm.wait_ready(w, work / f"{w}.ready", timeout_s=900.0 if vllm else 300)
    with console.status(f"submitting {len(jobs)} jobs (the trainers load the model)"):
        for j in jobs:
            j.trainer = trainers[j.source.trainer]
            j.endpoint = endpoints[j.trainer]
            j.run.keys, j.run.trainer_dir = {**keys, "trainer": keys[j.trainer]}, work / j.trainer
            j.run.job_id = submit_signed(j.endpoint, sign_job(keys["submitter"], j.spec, j.dataset))
    swarm.wait_ready("validator", work / "validator.ready")
    _announce(work, jobs, [*trainers, "validator", *workers], peers)
    t0 = time.monotonic()
    disk = DiskWatch([work / t for t in trainers])
    follow_all(swarm, jobs, opts.timeout_s, ["bootstrap", *trainers, "validator"], disk.sample)
    return _finish(swarm, jobs, opts, work, keys, workers, trainers, disk, t0)


def _announce(work: Path, jobs: list[UpJob], names: list[str], peers: list[str]) -> None:
    """Write `work/endpoints.json` (each job's page, every role's /metrics, the listing command)
    and print where to look."""
    pages = {j.name: collect_endpoints(work, [j.trainer], j.run.job_id or "", trainer=j.trainer)["dashboard"]
             for j in jobs}
    listing = "swarmrl status --initial-peers " + " ".join(peers)
    endpoints = {"dashboard": pages, "metrics": collect_endpoints(work, names, "")["metrics"], "status": listing}
    write_ready(work / "endpoints.json", endpoints)
    for j in jobs:
        console.print(f"job {j.name}: {j.run.job_id} on {j.trainer}; page: {pages[j.name] or 'off'}",
                      markup=False, highlight=False)
    console.print(f"every job the swarm announces: {listing}", markup=False, highlight=False, soft_wrap=True)


def follow_all(swarm: LocalSwarm, jobs: list[UpJob], timeout_s: float, watch: list[str],
               sample: Callable[[], int]) -> None:
    """Print a line per job each time its step advances ("training NAME 3/6 ..."), until every
    job is done.

    Raises:
        SwarmFailed: a watched role exited, a trainer's status kept failing, or `timeout_s` passed.
    """
    deadline = time.monotonic() + timeout_s
    shown: dict[str, int] = {}
    failed = 0
    while True:
        swarm.check_alive(watch)
        try:
            states = {j.name: job_status(j.endpoint, j.run.job_id or "", history=1) for j in jobs}
        except grpc.RpcError as exc:
            transient = exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            failed = 0 if transient else failed + 1
            if failed > STATUS_ERRORS_IN_A_ROW or time.monotonic() > deadline:
                raise SwarmFailed(f"a trainer's status failed: {exc.code().name}: {exc.details()}") from exc
            time.sleep(2.0)
            continue
        failed = 0
        sample()
        for j in jobs:
            st = states[j.name]
            if shown.get(j.name) != st.step:
                shown[j.name] = int(st.step)
                console.print(f"training {j.name} {st.step}/{j.spec.steps}  {progress_info(st)}", markup=False,
                              highlight=False, soft_wrap=True)
        if all(st.state == "done" for st in states.values()):
            return
        if time.monotonic() > deadline:
            at = ", ".join(f"{n} {st.step}/{st.total_steps}" for n, st in states.items())
            raise SwarmFailed(f"jobs not done after {timeout_s:.0f}s ({at})")
        time.sleep(0.5)


def _finish(swarm: LocalSwarm, jobs: list[UpJob], opts: UpOptions, work: Path, keys: dict[str, Any],
            workers: list[str], trainers: list[str], disk: DiskWatch, t0: float) -> dict[str, Any]:
    """Fetch each adapter, wait for the workers, settle the validator's checks, audit each job's
    credit books (as the one-job `up` does), write each job's files and the run's summary, and
    print it."""
    fetched = {}
    for j in jobs:
        j.run.out.mkdir(parents=True, exist_ok=True)
        fetched[j.name] = fetch_job_adapter(j.endpoint, j.run.job_id or "", j.run.out / "adapter", opts.cache_dir)
    states = wait_workers(swarm, workers, work)
    seconds = time.monotonic() - t0
    statuses: dict[str, pb.JobStatus] = {}
    figures: dict[str, dict[str, Any]] = {}
    for j in jobs:
        st = statuses[j.name] = settle_validator(j.endpoint, j.run.job_id or "", j.spec)
        version, adapter_hash = fetched[j.name]
        one = summarize(st, j.spec, j.run.job_id or "", version, adapter_hash, states, keys, seconds)
        one.update(name=j.name, trainer=j.trainer, weight=j.spec.weight,
                   groups_admitted_by_worker=admitted_by_worker([st], keys, workers),
                   audit=audit_summary(j.endpoint, j.run.job_id or "", {w: keys[w] for w in workers}, workers,
                                       opts.cache_dir),
                   credit=credit_summary(j.endpoint, j.run.job_id or "", {keys[w].peer_id: w for w in workers}))
        write_outputs(j.run.out, st, one)
        j.run.finished = True
        figures[j.name] = job_figures(one, j.trainer, j.spec.weight, j.spec.steps, j.run.out / "adapter")
    split = worker_split(statuses, {w: keys[w].peer_id for w in workers})
    hosted = {t: [j.name for j in jobs if j.trainer == t] for t in trainers}
    summary = run_summary(jobs[0].spec.base_model, figures, split, hosted, seconds)
    summary["disk"] = disk.report()
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    print_run_summary(summary, opts.out)
    return summary


def _heldout(summary: dict[str, Any], opts: UpOptions, jobs: list[UpJob]) -> dict[str, Any]:
    """Held-out accuracy, greedy, base vs adapter, per job (as the one-job `up`'s headline): into
    the run's summary.json and one line per job on stdout; a failure is a warning, not a failed run."""
    if not opts.eval_n:
        return summary
    from swarmrl.node.evaluation.heldout import heldout_of_job

    for j in jobs:
        entry = summary["jobs"][j.name]
        try:
            with console.status(f"held-out evaluation of {j.name}: base vs adapter on {opts.eval_n} prompts"):
                base, tuned = heldout_of_job(j.run.out / "adapter", j.spec, j.dataset, n=opts.eval_n,
                                             cache_dir=opts.cache_dir)
        except Exception as exc:  # noqa: BLE001 - the training's outputs are kept; the figure is what failed
            entry["heldout_error"] = f"{type(exc).__name__}: {exc}"[:300]
            console.print(f"swarmrl up: warning: the held-out evaluation of {j.name} failed ({entry['heldout_error']})",
                          markup=False, highlight=False)
            continue
        entry.update(heldout_accuracy_base=base.accuracy, heldout_accuracy_adapter=tuned.accuracy, heldout_n=tuned.n)
        print(f"{j.name}: held-out accuracy, greedy: base {base.accuracy:.3f} -> adapter {tuned.accuracy:.3f} "
              f"(n={tuned.n})", flush=True)
    (opts.out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
    return summary


def _stop_and_keep(swarm: LocalSwarm, jobs: list[UpJob], by: str) -> None:
    """Stop the roles, then keep every submitted job's run so far in its folder (`by`: the
    signal's name, or "failure"); a second signal can't cut this short."""
    with saving():
        warm_plotting()
        swarm.stop_all()
        for j in jobs:
            if j.run.job_id is not None and not j.run.finished:
                j.run.out.mkdir(parents=True, exist_ok=True)
                j.run.kept = keep_what_it_did(j.run, by)


def _kept_line(jobs: list[UpJob]) -> str:
    kept = [f"{j.name} step {j.run.kept.steps}/{j.run.kept.total_steps}" for j in jobs if j.run.kept is not None]
    if not kept:
        return "nothing was kept (no job submitted yet)"
    return f"kept each job's run so far in its folder under {jobs[0].run.out.parent}: {', '.join(kept)}"


def _interrupted_line(signum: int, jobs: list[UpJob]) -> str:
    name = signal.Signals(signum).name
    if jobs and all(j.run.finished for j in jobs):
        return f"interrupted by {name} after the jobs ended: their outputs are kept (no held-out figures)"
    return f"interrupted by {name}: {_kept_line(jobs)}"
