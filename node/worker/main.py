"""The worker process: find jobs in the DHT, then work leases on them.

Main loop: find jobs -> pick one by demand (`market.JobMarket`: weighted power-of-two choices,
another job at once when a trainer is busy) -> lease -> catch up -> generate -> grade -> sign ->
submit. On a backend that batches adapters (vLLM) a round holds leases of up to
`jobs_per_round` jobs and generates them all in one engine batch (`lease_round.run_round`); on
transformers, rounds stay per job.
Beside it, a prefetch thread follows each job's head version (from the trainers' DHT records)
and pulls new adapter versions as soon as they are published, from peers first; the gossip node
serves what this worker holds to other peers.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from swarmrl.node.inference import build_backend
from swarmrl.node.models.base_model import (
    base_model_sha256,
    default_cache_dir,
    find_base_model,
    is_builtin_model,
    resolve_model_name,
)
from swarmrl.node.net import grpc_wire, tls
from swarmrl.node.net.grpc_wire import same_trainer_endpoint
from swarmrl.node.net.trainer_client import WorkerTrainer
from swarmrl.node.ops.metrics import metrics_urls, start_metrics
from swarmrl.node.runtime.config import WorkerConfig
from swarmrl.node.runtime.lifecycle import start_role, write_ready
from swarmrl.node.runtime.preflight import preflight
from swarmrl.node.swarm.datasets import DatasetFetchStats, DatasetStore, DatasetUnavailable
from swarmrl.node.swarm.dht import VerifiedRecord, find_jobs, join_swarm
from swarmrl.node.swarm.env_records import EnvAnnouncer, env_infos, package_mismatch
from swarmrl.node.swarm.gossip import GossipNode, UpdateCache
from swarmrl.node.worker.engine import EngineFailed
from swarmrl.node.worker.lease_round import Held, run_round
from swarmrl.node.worker.market import JobMarket
from swarmrl.node.worker.metrics import retired, worker_metrics
from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
from swarmrl.node.worker.red_team import RedTeam
from swarmrl.node.worker.session import AdapterBehind, JobSession, prefetch_followed
from swarmrl.protocol.envs import get_environment, installed_environments
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:   # annotations only
    from types import SimpleNamespace

    import hivemind
    from prometheus_client.core import Metric

    from swarmrl.node.inference.base import InferenceBackend

log = logging.getLogger(__name__)


def servable(records: list[VerifiedRecord], shas: set[str]) -> list[VerifiedRecord]:
    """Records of jobs on one of this worker's base models (exact weights, by sha256), newest first."""
    ok = [r for r in records if r.record.base_model_sha256.hex() in shas]
    return sorted(ok, key=lambda r: r.record.updated_ms, reverse=True)


def cannot_run(spec: JobSpec, environments: list[str]) -> str:
    """Why this worker must skip a job's task ("" when it can run it): a data-set job runs only
    built-in rewards; an installed environment must be listed in the worker's config and
    installed at the job's version (and package hash, when the job pins one); a reasoning-gym
    job needs the reasoning-gym release it pins."""
    if spec.dataset is not None:
        return ""
    if spec.reasoning_gym is not None:
        from swarmrl.protocol.envs.rg_env import RGTaskError, installed_version

        try:
            here = installed_version()
        except RGTaskError as exc:
            return str(exc)
        pinned = spec.reasoning_gym.rg_version
        return "" if not pinned or pinned == here else f"the job pins reasoning-gym {pinned}, this worker has {here}"
    if spec.environment not in environments:
        return f"environment {spec.environment!r} is not in this worker's environments {environments}"
    try:
        get_environment(spec.environment, spec.env_version)
    except Exception as exc:  # noqa: BLE001 - a missing or broken package: skip the job, say why
        return str(exc)
    return package_mismatch(spec, installed_environments())


def by_job(records: list[VerifiedRecord]) -> dict[str, list[VerifiedRecord]]:
    """Records grouped by job id (a job served by several trainers has one record per trainer)."""
    out: dict[str, list[VerifiedRecord]] = defaultdict(list)
    for r in records:
        out[r.record.job_id].append(r)
    return dict(out)


TRAINER_RETRY_S = 30.0
BUSY, REFUSED, WORKED = "busy", "refused", "worked"   # how a round ended (Worker._round)
Connect = Callable[[pb.JobRecord], WorkerTrainer]
"""A client of the trainer that signed a record (`grpc_wire.connect` by default; raises tls.PinError)."""


class Worker:
    """The job sessions of one worker process over one loaded base model."""

    def __init__(self, cfg: WorkerConfig, identity: Identity, dht: hivemind.DHT | None = None,
                 gossip: GossipNode | None = None, connect: Connect | None = None) -> None:
        self.cfg, self.identity = cfg, identity
        self.connect: Connect = connect or functools.partial(grpc_wire.connect, max_message_mb=cfg.max_message_mb,
                                                             peer_id=identity.peer_id)
        self.dht, self.gossip = dht, gossip
        names = [resolve_model_name(m) if is_builtin_model(m) else m for m in (cfg.base_models or [cfg.base_model])]
        self.backends: dict[str, InferenceBackend] = {}   # base-model sha256 -> backend (one load per model)
        for name in names:
            path = find_base_model(name, cfg.cache_dir)
            sha = base_model_sha256(path)
            if sha not in self.backends:
                self.backends[sha] = build_backend(cfg.backend, path, vllm_url=cfg.vllm_url, device=cfg.device,
                                                   max_jobs=max(2, cfg.jobs_per_round))
        self.model_name = names[0]
        self.sha256 = next(iter(self.backends))
        self.backend = self.backends[self.sha256]
        cache_dir = default_cache_dir() if cfg.cache_dir is None else cfg.cache_dir
        self.datasets = DatasetStore(cache_dir / "datasets")
        self.receipts = ReceiptStore(receipts_path(cache_dir, identity.peer_id))   # the trainers' signed receipts
        self.dataset_stats = DatasetFetchStats()
        self.skipped: dict[str, str] = {}   # job id -> why this worker does not serve it
        self.sessions: dict[str, JobSession] = {}
        self.finished: dict[str, dict[str, Any]] = {}
        self._failed_trainers: dict[str, float] = {}   # trainer id -> monotonic time until it is skipped
        self.market = JobMarket(cfg.max_job_weight)   # which job next; trainers skipped after a broken promise
        self.red_team = RedTeam(cfg.red_team) if cfg.red_team else None   # adversarial drill (local only)
        self.rounds_by_jobs: Counter[int] = Counter()   # rounds that ran, by the jobs their batch carried
        self.retired: dict[str, SimpleNamespace] = {}   # job id -> what the metrics keep of a finished session
        self.ops_urls: dict[str, str] = {}   # {"metrics": URL} once the metrics server runs
        self.announcer = (EnvAnnouncer(dht, identity, env_infos(cfg.environments), list(self.backends))
                          if dht is not None else None)   # what this worker serves, in the DHT

    def metrics(self) -> Iterator[Metric]:
        """This worker's /metrics families now (`worker_metrics`; what a scrape reads)."""
        return worker_metrics(self.sessions, self.retired, self.skipped, self.dataset_stats)

    def session(self, rec: VerifiedRecord) -> JobSession:
        """The session of the record's job, opened on first use (a LoRA slot on the backend of the
        job's base model, a client of the record's trainer: `connect`); a session that follows
        another trainer's endpoint now gets a client of the new one."""
        job_id = rec.record.job_id
        session = self.sessions.get(job_id)
        if session is None:
            spec = JobSpec.from_json(rec.record.spec_json)
            backend = self.backends[rec.record.base_model_sha256.hex()]
            backend.add_slot(job_id, spec.lora)
            trainer = self.connect(rec.record)
            try:
                session = JobSession(
                    rec.record, trainer, identity=self.identity, backend=backend, max_prompts=self.cfg.max_prompts,
                    datasets=self.datasets, dataset_stats=self.dataset_stats, grade_timeout_s=self.cfg.grade_timeout_s,
                    gossip=self.gossip, dht=self.dht if self.gossip is not None else None, max_gap=self.cfg.max_gap,
                    peer_wait_s=self.cfg.peer_wait_s, max_peer_attempts=self.cfg.max_peer_attempts,
                    wait_rule=self.cfg.wait_rule, snapshot_rule=self.cfg.snapshot_rule, receipts=self.receipts)
            except BaseException:
                trainer.close()
                raise
            self.sessions[job_id] = session
        elif not same_trainer_endpoint(session.record, rec.record):
            session.use_record(rec.record, self.connect(rec.record))
        else:
            session.use_record(rec.record)
        return session

    def choose(self, records: list[VerifiedRecord]) -> VerifiedRecord:
        """The trainer record to follow for one job: the preferred trainer, else the one followed
        now, else one picked by rendezvous hashing (spreads workers over trainers); trainers that
        failed recently, or refused a lease they had announced (`JobMarket.skipped`), are skipped
        while another is there."""
        now = time.monotonic()
        ok = [r for r in records if self._failed_trainers.get(r.trainer_id, 0.0) <= now]
        ok = [r for r in ok if not self.market.skipped(r)] or ok or records
        current = self.sessions.get(ok[0].record.job_id)
        for r in ok:
            if r.trainer_id == self.cfg.prefer_trainer:
                return r
        for r in ok:
            if current is not None and r.trainer_id == current.record.trainer_id:
                return r
        return min(ok, key=lambda r: hashlib.sha256((self.identity.peer_id + r.trainer_id).encode()).digest())

    def finish(self, rec: VerifiedRecord, version: int | None = None) -> None:
        """A job is done: catch up to its final version (so we hold and can serve it), then close."""
        session = self.session(rec)
        session.catch_up(int(rec.record.head_version) if version is None else version)
        self.finished[rec.record.job_id] = {"version": session.replica.version, "hash": session.replica.hash.hex(),
                                            "trainer": session.record.trainer_id, "sync": session.sync.stats.report()}
        session.close()
        self.retired[rec.record.job_id] = retired(session)   # its metrics stay (worker.metrics)
        del self.sessions[rec.record.job_id]
        log.info("job %s done; holding final version %d", rec.record.job_id, session.replica.version)

    def report(self) -> dict[str, Any]:
        """The worker's ready file: peer id, per job the adapter it holds (version, hash, trainer,
        sync figures, bytes served to peers), skipped jobs, jobs whose records are ignored now
        (bad demand), rounds by the jobs they carried, data-set sources, and `cpu_s`: this
        process's CPU seconds so far (user + system, every thread; not its grading processes)."""
        adapters = {j: {"version": s.replica.version, "hash": s.replica.hash.hex(), "trainer": s.record.trainer_id,
                        "sync": s.sync.stats.report()} for j, s in list(self.sessions.items())}
        adapters.update(self.finished)
        served = {j: self.gossip.served_bytes(j) for j in adapters} if self.gossip is not None else {}
        for j, a in adapters.items():
            a["peer_upload_bytes"] = served.get(j, 0)
        stats = {j: s.stats for j, s in self.retired.items()} | {j: s.stats for j, s in list(self.sessions.items())}
        for j, st in stats.items():
            if j in adapters:
                adapters[j]["receipts"] = {"kept": st.receipts_kept, "refused": dict(st.receipts_refused)}
        out = {"peer_id": self.identity.peer_id, "adapters": adapters, "peer_upload_bytes": sum(served.values()),
               "skipped_jobs": dict(self.skipped), "ignored_jobs": dict(self.market.ignored),
               "rounds_by_jobs": {str(k): n for k, n in sorted(self.rounds_by_jobs.items())},
               "dataset_sources": dict(self.dataset_stats.sources),
               "dataset_refused": dict(self.dataset_stats.refused), "cpu_s": round(time.process_time(), 2),
               **self.ops_urls}
        if self.red_team is not None:
            out["red_team"] = self.red_team.report()
        return out

    def runnable(self, records: list[VerifiedRecord]) -> list[VerifiedRecord]:
        """The records of jobs whose task this worker runs; the others are skipped, with a reason logged once."""
        out = []
        for r in records:
            job_id = r.record.job_id
            if job_id not in self.skipped:
                try:
                    spec = JobSpec.from_json(r.record.spec_json)
                    reason = cannot_run(spec, self.cfg.environments) or self._sampling_problem(r, spec)
                except ValueError as exc:
                    reason = f"unreadable job spec: {exc}"
                if reason:
                    self.skipped[job_id] = reason
                    log.warning("skipping job %s: %s", job_id, reason)
            if not self.skipped.get(job_id):
                out.append(r)
        return out

    def _sampling_problem(self, rec: VerifiedRecord, spec: JobSpec) -> str:
        """A configuration error: the job's backend can't report its sampling log-probs in the
        swarm's convention (vLLM at top_p < 1). "" when it can."""
        backend = self.backends.get(rec.record.base_model_sha256.hex())
        problem = backend.sampling_problem(spec.sampling.temperature, spec.sampling.top_p) if backend else ""
        return f"configuration error: {problem}" if problem else ""

    def tick(self, dht: hivemind.DHT, stop: threading.Event) -> bool:
        """One look at the jobs the DHT announces (`work`). Returns False when there is nothing left to do."""
        return self.work(find_jobs(dht), stop)

    def work(self, found: list[VerifiedRecord], stop: threading.Event) -> bool:
        """Finish the jobs that are done, then one round on the job the market picks among those
        whose records' demand is sound (`market.JobMarket`); when its trainer refuses as busy,
        another job at once. Waits `poll_s` when no job wants work. Returns False when there is
        nothing left to do (with `exit_when_done`: no job wants work and `exit_after_jobs` are done)."""
        jobs = by_job(self.runnable(servable(found, set(self.backends))))
        live: dict[str, VerifiedRecord] = {}
        for job_id, records in jobs.items():
            done = [r for r in records if r.record.done]
            if done:
                if job_id not in self.finished:
                    final = max(int(r.record.head_version) for r in done)
                    self._guard(functools.partial(self.finish, version=final), self.choose(records), stop)
                continue
            sound = self.market.sound(records, JobSpec.from_json(records[0].record.spec_json))
            if sound:
                live[job_id] = self.choose(sound)
        self.market.forget_except(set(jobs))
        worked = self._serve(live, stop)
        write_ready(self.cfg.ready_file, self.report())
        if not worked:
            stop.wait(self.cfg.poll_s)
        return bool(live) or not (self.cfg.exit_when_done and len(self.finished) >= self.cfg.exit_after_jobs)

    def _serve(self, live: dict[str, VerifiedRecord], stop: threading.Event) -> bool:
        """One round on the job the market picks from `live` (job id -> record followed), or on
        up to `jobs_per_round` jobs where the backend batches adapters (`_serve_many`); a job
        whose trainer refuses as busy is skipped (`JobMarket.refused_busy`) and the next is
        picked at once. Returns whether a round ran (False: no job wanted work)."""
        k = self.cfg.jobs_per_round if self.backend.batches_adapters and self.red_team is None else 1
        if k > 1:
            return self._serve_many(live, stop, k)
        left = dict(live)
        while (job_id := self.market.pick(left)) is not None:
            rec = left.pop(job_id)
            if self._guard(lambda r: self._round(self.session(r), r, stop), rec, stop) != BUSY:
                return True
        return False

    def _serve_many(self, live: dict[str, VerifiedRecord], stop: threading.Event, k: int) -> bool:
        """One round holding leases of up to `k` jobs on one base model's backend (the market's
        `plan`; a busy trainer's place is filled again at once), all generated in one engine
        batch and each submitted to its own trainer (`lease_round.run_round`). Returns whether a
        round ran; waits `poll_s` when every job refused or failed."""
        left, held, failed = dict(live), [], False
        plan = self.market.plan(left, k)
        sha = live[plan[0]].record.base_model_sha256 if plan else b""
        while plan:
            busy = False
            for job_id in plan:
                rec = left.pop(job_id)
                if rec.record.base_model_sha256 != sha:
                    continue   # another base model's engine: a later round
                got = self._guard(self._lease, rec, stop, wait=False)
                busy |= got == BUSY
                failed |= got is None or got == REFUSED
                if isinstance(got, Held):
                    held.append(got)
            plan = self.market.plan(left, k - len(held), keep=False) if busy and len(held) < k else []
        self.market.keep([h.job_id for h in held])
        if held:
            guard = functools.partial(self._guard, stop=stop, wait=False)
            for h, result in run_round(self.backends[sha.hex()], held, guard):
                log.info("job %s lease %s v%d: %d/%d groups admitted (a round of %d jobs)", h.job_id,
                         result.lease_id, result.policy_version, result.admitted, result.groups, len(held))
            self.rounds_by_jobs[len(held)] += 1
        elif failed:
            stop.wait(self.cfg.poll_s)
        return bool(held) or failed

    def _lease(self, rec: VerifiedRecord) -> Held | str:
        """A lease of `rec`'s job for a round of several jobs, or why not: BUSY (the trainer is
        skipped a while: `JobMarket.refused_busy`) or REFUSED. Raises what `_guard` absorbs."""
        session = self.session(rec)
        session.catch_up_to_head()
        lease = session.request_lease()
        if lease is None:
            if session.last_refusal == "busy":
                self.market.refused_busy(rec, session.last_retry_ms)
                return BUSY
            return REFUSED
        self.market.granted(rec)
        return Held(rec, session, lease)

    def prefetch_loop(self, stop: threading.Event) -> None:
        """Pull each followed job's newest version as soon as a trainer announces it (replica only;
        the backend loads it at the next lease), and keep this worker's holdings announced. A job
        is followed while a round chose it within `follow_idle_s` (`protocol.market.follows`)."""
        while not stop.wait(self.cfg.sync_poll_s * random.uniform(0.5, 1.5)):
            try:
                jobs = by_job(servable(find_jobs(self.dht), set(self.backends)))
                heads = {job_id: max(int(r.record.head_version) for r in recs) for job_id, recs in jobs.items() if recs}
                prefetch_followed(self.sessions, heads, self.cfg.follow_idle_s, time.monotonic())
                if self.gossip is not None:
                    self.gossip.refresh()
                if self.announcer is not None:
                    self.announcer.refresh()
            except Exception as exc:  # noqa: BLE001 - a peer, trainer or the DHT failed: the next poll retries
                log.warning("prefetch failed: %r", exc)

    def _round(self, session: JobSession, rec: VerifiedRecord, stop: threading.Event) -> str:
        """One lease round on `rec`'s job: BUSY when the trainer refused as busy (no wait: the
        caller picks another job), else REFUSED (after waiting `poll_s`) or WORKED."""
        result = session.work_once() if self.red_team is None else self.red_team.work_once(session)
        if result is None:
            if session.last_refusal == "busy":
                self.market.refused_busy(rec, session.last_retry_ms)
                return BUSY
            stop.wait(self.cfg.poll_s)
            return REFUSED
        self.market.granted(rec)
        self.market.keep([rec.record.job_id])
        self.rounds_by_jobs[1] += 1
        log.info("job %s lease %s v%d: %d/%d groups admitted", session.job_id, result.lease_id,
                 result.policy_version, result.admitted, result.groups)
        return WORKED

    def _guard(self, fn: Callable[[VerifiedRecord], object], rec: VerifiedRecord, stop: threading.Event,
               wait: bool = True) -> object:
        """`fn(rec)`'s result; None when a peer, the trainer or the engine failed (the failure is
        logged, a trainer that can't be reached is skipped for TRAINER_RETRY_S, and the call
        waits `poll_s` unless `wait` is False: a round of several jobs waits once, at its end)."""
        try:
            return fn(rec)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._failed_trainers[rec.trainer_id] = time.monotonic() + TRAINER_RETRY_S
            log.warning("job %s: trainer call failed (%s: %s); retrying", rec.record.job_id, exc.code(), exc.details())
        except tls.PinError as exc:   # unreachable, or not the certificate its signed record pins
            self._failed_trainers[rec.trainer_id] = time.monotonic() + TRAINER_RETRY_S
            log.warning("job %s: %s; retrying", rec.record.job_id, exc)
        except DatasetUnavailable as exc:
            log.warning("job %s: %s; retrying", rec.record.job_id, exc)
        except AdapterBehind as exc:
            log.info("job %s: %s; retrying", rec.record.job_id, exc)
        except EngineFailed as exc:   # the lease is skipped (it expires at the trainer); keep serving
            log.error("job %s: %s; lease skipped", rec.record.job_id, exc)
        if wait:
            stop.wait(self.cfg.poll_s)
        return None

    def close(self) -> None:
        """Close every open job session, then the backends (a vLLM server ends with them)."""
        for s in self.sessions.values():
            s.close()
        for b in self.backends.values():
            b.close()
        self.receipts.close()


def run(cfg: WorkerConfig) -> None:
    """Start the worker and work until SIGTERM (or, with exit_when_done, until its jobs are done)."""
    preflight(cfg)   # what --dry-run checks: ports, base models
    stop, identity = start_role("worker", cfg.key, cfg.threads)
    dht = join_swarm(cfg.net)
    cache = UpdateCache(keep_deltas=cfg.keep_deltas, keep_snapshots=cfg.keep_snapshots, keep_jobs=cfg.keep_jobs)
    gossip = (GossipNode(dht, identity, cache, dialable=not cfg.net.client_mode,
                         max_snapshot_streams=cfg.max_snapshot_streams) if cfg.gossip else None)
    worker = Worker(cfg, identity, dht, gossip)
    ops = start_metrics(cfg.metrics_host, cfg.metrics_port, worker.metrics)
    worker.ops_urls = metrics_urls(ops)
    write_ready(cfg.ready_file, worker.report())
    if worker.announcer is not None:
        worker.announcer.refresh(force=True)
    log.info("worker %s serving %s", identity.peer_id, worker.model_name)
    done = threading.Event()
    prefetcher = threading.Thread(target=worker.prefetch_loop, args=(done,), name="prefetch", daemon=True)
    prefetcher.start()
    try:
        while not stop.is_set() and worker.tick(dht, stop):
            pass
        stop.wait(cfg.linger_s)   # keep serving what we hold while peers fetch the final version
        write_ready(cfg.ready_file, worker.report())
    finally:
        done.set()
        prefetcher.join(timeout=10)
        if ops is not None:
            ops.close()
        worker.close()
        if gossip is not None:
            gossip.shutdown()
        dht.shutdown()
