"""The worker process: find jobs in the DHT, then work leases on them.

Main loop: find jobs -> pick one -> lease -> catch up -> generate -> grade -> sign -> submit.
"""

from __future__ import annotations

import logging
import threading

import grpc

from swarmrl.node.config import WorkerConfig
from swarmrl.node.inference import build_backend
from swarmrl.node.models import base_model_sha256, prepare_base_model, resolve_model_name
from swarmrl.node.runtime import set_threads, setup_logging, stop_event, write_ready
from swarmrl.node.swarm.dht import VerifiedRecord, find_jobs, start_dht
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec

log = logging.getLogger(__name__)


def servable(records: list[VerifiedRecord], base_model: str, sha256: str) -> list[VerifiedRecord]:
    """Records of jobs on this worker's base model (exact weights), newest first."""
    ok = [r for r in records if r.record.base_model_sha256.hex() == sha256
          and resolve_model_name(r.record.base_model) == base_model]
    return sorted(ok, key=lambda r: r.record.updated_ms, reverse=True)


class Worker:
    """The job sessions of one worker process over one loaded base model."""

    def __init__(self, cfg: WorkerConfig, identity: Identity) -> None:
        self.cfg, self.identity = cfg, identity
        self.model_name = resolve_model_name(cfg.base_model)
        path = prepare_base_model(self.model_name, cfg.cache_dir)
        self.sha256 = base_model_sha256(path)
        self.backend = build_backend(cfg.backend, path)
        self.sessions: dict[str, JobSession] = {}
        self.finished: dict[str, dict] = {}

    def session(self, rec: VerifiedRecord) -> JobSession:
        job_id = rec.record.job_id
        if job_id not in self.sessions:
            spec = JobSpec.from_json(rec.record.spec_json)
            self.backend.add_slot(job_id, spec.lora)
            self.sessions[job_id] = JobSession(
                rec.record, identity=self.identity, backend=self.backend, max_prompts=self.cfg.max_prompts,
                max_message_mb=self.cfg.max_message_mb, grade_timeout_s=self.cfg.grade_timeout_s)
        return self.sessions[job_id]

    def finish(self, rec: VerifiedRecord) -> None:
        """A job is done: catch up to its final version (so we hold and can serve it), then close."""
        session = self.session(rec)
        session.catch_up(int(rec.record.head_version))
        self.finished[rec.record.job_id] = {"version": session.replica.version, "hash": session.replica.hash.hex()}
        session.close()
        del self.sessions[rec.record.job_id]
        log.info("job %s done; holding final version %d", rec.record.job_id, session.replica.version)

    def report(self) -> dict:
        adapters = {j: {"version": s.replica.version, "hash": s.replica.hash.hex()} for j, s in self.sessions.items()}
        return {"peer_id": self.identity.peer_id, "adapters": {**adapters, **self.finished}}

    def tick(self, dht, stop: threading.Event) -> bool:  # noqa: ANN001
        """One pass over the known jobs. Returns False when there is nothing left to do."""
        records = servable(find_jobs(dht), self.model_name, self.sha256)
        for rec in records:
            if rec.record.done and rec.record.job_id not in self.finished:
                self._guard(self.finish, rec, stop)
        live = [r for r in records if not r.record.done]
        for rec in live:
            self._guard(lambda r: self._round(self.session(r), stop), rec, stop)
        write_ready(self.cfg.ready_file, self.report())
        if not live:
            stop.wait(self.cfg.poll_s)
        return bool(live) or not (self.cfg.exit_when_done and self.finished)

    def _round(self, session: JobSession, stop: threading.Event) -> None:
        result = session.work_once()
        if result is None:
            stop.wait(self.cfg.poll_s)
        else:
            log.info("job %s lease %s v%d: %d/%d groups admitted", session.job_id, result.lease_id,
                     result.policy_version, result.admitted, result.groups)

    def _guard(self, fn, rec: VerifiedRecord, stop: threading.Event) -> None:  # noqa: ANN001
        try:
            fn(rec)
        except grpc.RpcError as exc:
            log.warning("job %s: trainer call failed (%s); retrying", rec.record.job_id, exc.code())
            stop.wait(self.cfg.poll_s)

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()


def run(cfg: WorkerConfig) -> None:
    """Start the worker and work until SIGTERM (or, with exit_when_done, until its jobs are done)."""
    setup_logging("worker")
    set_threads(cfg.threads)
    stop = stop_event()
    identity = Identity.load_or_create(cfg.key)
    worker = Worker(cfg, identity)
    dht = start_dht(cfg.net.initial_peers, host=cfg.net.host, port=cfg.net.dht_port)
    write_ready(cfg.ready_file, worker.report())
    log.info("worker %s serving %s", identity.peer_id, worker.model_name)
    try:
        while not stop.is_set() and worker.tick(dht, stop):
            pass
    finally:
        worker.close()
        dht.shutdown()
