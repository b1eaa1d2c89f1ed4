"""The trainer process: hosts jobs, serves gRPC, announces jobs in the DHT, trains.

Main loop: announce -> expire leases -> coordinate with cotrainers -> (for each job with a full
batch, or whose cotrainer is looking for an averaging group) train_step.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from swarmrl.node import tls
from swarmrl.node.config import TrainerConfig
from swarmrl.node.grpc_server import GuardedServer
from swarmrl.node.models import find_base_model_by_sha
from swarmrl.node.runtime import StartupError, start_role, write_ready
from swarmrl.node.swarm.dht import REFRESH_S, VerifiedRecord, announce_job, find_jobs, visible_maddrs
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.trainer.checkpoint import prune_checkpoints
from swarmrl.node.trainer.faults import reducer_wrap
from swarmrl.node.trainer.job import JobRuntime, now_ms
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.ops import ops_urls, start_trainer_ops
from swarmrl.node.trainer.retention import Retention
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import signing
from swarmrl.protocol.admission import claimed_job_id
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec, job_id_from_body
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    import hivemind

    from swarmrl.node.grpc_guard import StreamGuard

log = logging.getLogger(__name__)
COTRAINER_LOOK_S = 0.5   # how often the job records are read to follow cotrainers


class Trainer:
    """The jobs of one trainer process, and the operations the gRPC service calls."""

    def __init__(self, cfg: TrainerConfig, identity: Identity, dht: hivemind.DHT | None = None) -> None:
        self.cfg, self.identity, self.dht = cfg, identity, dht
        self.ledger = Ledger(cfg.state_dir / "ledger.sqlite", synchronous=cfg.ledger_sync)
        self.jobs: dict[str, JobRuntime] = {}
        self.upload_bytes = 0
        self.unrouted_rejections = 0  # batches naming no job we host (or unparseable): nothing to count them under
        self.grpc_guard: StreamGuard | None = None   # the gRPC server's stream guard, once serving (metrics)
        self._lock = threading.Lock()
        for job_id, envelope in self.ledger.jobs():
            job, _ = signing.open_signed(envelope, signing.JOB, pb.Job)
            self._host(job_id, JobSpec.from_json(job.spec_json), bytes(job.dataset) or None)

    def _host(self, job_id: str, spec: JobSpec, dataset: bytes | None = None) -> JobRuntime:
        path = find_base_model_by_sha(spec.base_model, spec.base_model_sha256, self.cfg.base_models, self.cfg.cache_dir)
        runtime = JobRuntime(job_id, spec, identity=self.identity, model_path=path, state_dir=self.cfg.state_dir,
                             dataset=dataset,
                             ledger=self.ledger, prompt_shard=self.cfg.prompt_shard,
                             probation_ms=int(self.cfg.probation_s * 1000) if self.cfg.trusted_validators else 0,
                             wrap_reducer=reducer_wrap(self.cfg.fault), device=self.cfg.device,
                             ledger_keep_ms=int(self.cfg.ledger_keep_s * 1000))
        runtime.store.retention = Retention(self.cfg.keep_versions, self.cfg.keep_snapshots, spec.max_async_level)
        if self.dht is not None:
            runtime.attach_swarm(JobSwarm(
                self.dht, self.identity.peer_id, job_id,
                allowed=set(self.cfg.cotrainers) if self.cfg.cotrainers is not None else None,
                matchmaking_s=self.cfg.averaging_matchmaking_s, timeout_s=self.cfg.averaging_timeout_s))
        self.jobs[job_id] = runtime
        return runtime

    def submit_job(self, envelope: pb.Signed) -> pb.JobAck:
        """Verify a signed job, check its spec and base model, and start hosting it."""
        try:
            job, submitter = signing.open_signed(envelope, signing.JOB, pb.Job)
            spec = JobSpec.from_json(job.spec_json)
        except (signing.SignatureError, ValueError) as exc:
            return pb.JobAck(accepted=False, reason=f"invalid job: {exc}"[:500])
        job_id = job_id_from_body(envelope.body)
        if self.cfg.allowed_submitters is not None and submitter not in self.cfg.allowed_submitters:
            return pb.JobAck(job_id=job_id, accepted=False, reason=f"submitter {submitter} not allowed")
        with self._lock:
            if job_id not in self.jobs:
                try:
                    self._host(job_id, spec, bytes(job.dataset) or None)
                except (ValueError, RuntimeError) as exc:
                    return pb.JobAck(job_id=job_id, accepted=False, reason=str(exc)[:500])
                self.ledger.add_job(job_id, envelope, now_ms())
                log.info("hosting job %s (%s on %s) from %s", job_id, spec.environment_id, spec.base_model, submitter)
        return pb.JobAck(job_id=job_id, accepted=True)

    def admit(self, envelope: pb.Signed, on_verified: Callable[[str], None] | None = None) -> pb.BatchReceipt:
        """Route a signed rollout batch to its job, which verifies it (`Admission.admit`, with
        `on_verified`)."""
        job = self.jobs.get(_claimed_job_id(envelope))
        if job is None:
            self.unrouted_rejections += 1
            return pb.BatchReceipt(batch_id=signing.envelope_id(envelope), accepted=False, reason="unknown_job")
        return job.admission.admit(envelope, self.cfg.max_batch_mb << 20, on_verified=on_verified)

    def report_verdicts(self, envelope: pb.Signed) -> pb.VerdictAck:
        """Act on a trusted validator's signed verdicts."""
        try:
            report, validator = signing.open_signed(envelope, signing.VERDICTS, pb.VerdictReport)
        except signing.SignatureError as exc:
            return pb.VerdictAck(reason=exc.reason)
        if validator not in self.cfg.trusted_validators:
            return pb.VerdictAck(reason=f"validator {validator} is not trusted by this trainer")
        job = self.jobs.get(report.job_id)
        if job is None:
            return pb.VerdictAck(reason="unknown_job")
        banned = job.admission.apply_verdicts(validator, report)
        return pb.VerdictAck(accepted=len(report.verdicts), banned=banned)

    def dataset_bytes(self, sha256_hex: str) -> bytes | None:
        """The data-set file of a hosted job, by sha256 (served to workers and validators)."""
        for runtime in list(self.jobs.values()):
            task = runtime.spec.dataset
            if task is not None and task.dataset_sha256 == sha256_hex and runtime.dataset is not None:
                return runtime.dataset
        return None

    def count_upload(self, n: int) -> None:
        """Add `n` bytes to what this trainer served (adapters and data sets, to anyone)."""
        with self._lock:
            self.upload_bytes += n


def _claimed_job_id(envelope: pb.Signed) -> str:
    """The job id a batch claims, read BEFORE verification: used only to route the batch (and
    count its rejection) to that job, which then verifies everything, its job id included."""
    return claimed_job_id(envelope.body)


class TrainerLoop:
    """The phases of the trainer's main loop: announce -> coordinate with cotrainers -> step."""

    def __init__(self, trainer: Trainer, dht: hivemind.DHT, identity: Identity, endpoint: str,
                 tls_cert_sha256: bytes = b"") -> None:
        self.trainer, self.dht, self.identity, self.endpoint = trainer, dht, identity, endpoint
        self.tls_cert_sha256 = tls_cert_sha256
        self.maddrs = visible_maddrs(dht)
        self.last_announce = self.last_look = 0.0
        self.finished: set[str] = set()

    def announce(self, job: JobRuntime) -> None:
        """Put the job's signed record (version, announced endpoint and multiaddrs, pinned TLS
        certificate, cotrainers) in the DHT now."""
        record = job.record(self.endpoint)
        record.tls_cert_sha256, record.maddrs[:] = self.tls_cert_sha256, self.maddrs
        announce_job(self.dht, self.identity, record)

    def announce_if_due(self) -> None:
        """Refresh every job's signed DHT record every REFRESH_S."""
        if time.monotonic() - self.last_announce > REFRESH_S:
            for job in list(self.trainer.jobs.values()):
                self.announce(job)
            self.last_announce = time.monotonic()

    def look_for_cotrainers_if_due(self) -> list[VerifiedRecord] | None:
        """The DHT's job records every COTRAINER_LOOK_S (None in between)."""
        if not self.trainer.jobs or time.monotonic() - self.last_look <= COTRAINER_LOOK_S:
            return None
        self.last_look = time.monotonic()
        return find_jobs(self.dht)

    def coordinate(self, job: JobRuntime, records: list[VerifiedRecord] | None) -> None:
        """Adopt a cotrainer's newer version or notice cotrainers come and go; re-announce on change."""
        if records is None:
            return
        before = (job.version, job.cotrainer_ids())
        job.coordinate(records)
        if (job.version, job.cotrainer_ids()) != before:
            self.announce(job)

    def tidy(self, job: JobRuntime) -> None:
        """Once a job is done, keep only its last checkpoint (the adapter store keeps its window
        of versions: validators may still check the last admitted rollouts)."""
        if job.done and job.job_id not in self.finished:
            prune_checkpoints(job.dir / "checkpoints", keep=1)
            self.finished.add(job.job_id)

    def step(self, job: JobRuntime) -> bool:
        """Train one step when a batch is ready (or a cotrainer opened a round); True if it stepped."""
        if not (job.ready() or job.peer_round_open()):
            return False
        row = job.train_step()
        if row is None:
            return False
        log.info("job %s step %d reward %.3f loss %.4f", job.job_id, int(row["step"]), row["reward_mean"], row["loss"])
        self.announce(job)
        return True


def run(cfg: TrainerConfig) -> None:
    """Start the trainer and serve until SIGTERM."""
    stop, identity, dht = start_role("trainer", cfg.key, cfg.net, cfg.threads)
    trainer = Trainer(cfg, identity, dht)
    grpc_side = serve_grpc(trainer, cfg)
    # a weak proxy: the trainer must not keep the server's guard alive past the server (with a
    # strong one the trainer did not exit within 10 s of SIGTERM in two runs of test_lifecycle, it
    # sat in garbage collection at interpreter exit; with this it exits in ~6 s, as before)
    trainer.grpc_guard = cast("StreamGuard", weakref.proxy(grpc_side.server.guard))
    endpoint = grpc_side.announce
    ops = start_trainer_ops(trainer, cfg)
    write_ready(cfg.ready_file, {"endpoint": grpc_side.local, "announce": endpoint, "peer_id": identity.peer_id,
                                 "maddrs": visible_maddrs(dht), "tls_sha256": grpc_side.cert_sha256.hex(),
                                 **ops_urls(ops)})
    log.info("trainer %s serving on %s%s", identity.peer_id, endpoint, " (TLS)" if cfg.tls else "")
    loop = TrainerLoop(trainer, dht, identity, endpoint, grpc_side.cert_sha256)
    try:
        while not stop.is_set():
            loop.announce_if_due()
            records = loop.look_for_cotrainers_if_due()
            stepped = False
            for job in list(trainer.jobs.values()):
                job.admission.expire_leases()
                loop.coordinate(job, records)
                stepped |= loop.step(job)
                loop.tidy(job)
            if not stepped:
                stop.wait(0.2)
    finally:
        if ops is not None:
            ops.close()
        grpc_side.stop()   # bounded: returns within ~3 s per server even if a handler is stuck
        for job in trainer.jobs.values():
            if job.cotraining is not None:
                job.cotraining.swarm.shutdown()
        trainer.ledger.close()
        dht.shutdown()


@dataclass
class GrpcSide:
    """The trainer's gRPC servers: `announce` (HOST:PORT put in the job records; TLS when
    `cert_sha256`) and `local` (what tools on this machine dial: the same server, or with TLS a
    plaintext one on 127.0.0.1)."""

    server: GuardedServer
    announce: str
    local: str
    cert_sha256: bytes = b""
    local_server: GuardedServer | None = None

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the servers (in-flight calls get `grace_s`)."""
        for s in (self.server, self.local_server):
            if s is not None:
                s.stop(grace=grace_s).wait()


def serve_grpc(trainer: Trainer, cfg: TrainerConfig) -> GrpcSide:
    """Serve gRPC on `grpc_host` (default `net.host`), with TLS when `cfg.tls` (a self-signed
    certificate in state_dir/tls, pinned by its sha256 in the job records) and then also plaintext
    on 127.0.0.1 for tools on this machine (`swarmrl status`, `swarmrl up`)."""
    host = cfg.grpc_host or cfg.net.host
    wildcard = host in ("0.0.0.0", "::", "[::]")
    if wildcard and not cfg.grpc_announce:
        raise StartupError(f"grpc_host {host} listens everywhere: set grpc_announce to the HOST:PORT workers should dial")
    announce_host = cfg.grpc_announce.rpartition(":")[0] if cfg.grpc_announce else host
    if not cfg.tls:
        server, port = serve(trainer, host, cfg.grpc_port, cfg.max_message_mb, limits=cfg.grpc_limits,
                             rate_limits=cfg.rate_limits)
        return GrpcSide(server, cfg.grpc_announce or f"{host}:{port}", f"{'127.0.0.1' if wildcard else host}:{port}")
    cert = tls.load_or_create(cfg.state_dir / "tls", [h for h in {host, announce_host} if h not in ("0.0.0.0", "::")])
    server, port = serve(trainer, host, cfg.grpc_port, cfg.max_message_mb, credentials=cert.credentials(),
                         limits=cfg.grpc_limits, rate_limits=cfg.rate_limits)
    local_server, local_port = serve(trainer, "127.0.0.1", 0, cfg.max_message_mb, limits=cfg.grpc_limits,
                                     rate_limits=cfg.rate_limits)
    return GrpcSide(server, cfg.grpc_announce or f"{host}:{port}", f"127.0.0.1:{local_port}", cert.sha256,
                    local_server)
