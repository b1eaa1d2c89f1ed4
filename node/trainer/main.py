"""The trainer process: hosts jobs, serves gRPC, announces jobs in the DHT, trains.

Main loop: announce -> expire leases -> coordinate with cotrainers -> (for each job with a full
batch, or whose cotrainer is looking for an averaging group) train_step.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from swarmrl.node.net import tls
from swarmrl.node.net.grpc_server import GuardedServer
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.runtime.lifecycle import StartupError, start_role, write_ready
from swarmrl.node.runtime.preflight import preflight
from swarmrl.node.swarm.dht import (
    REFRESH_S,
    VerifiedRecord,
    announce_job,
    find_jobs,
    join_swarm,
    visible_maddrs,
)
from swarmrl.node.swarm.statement_gossip import Source, StatementGossip
from swarmrl.node.trainer.checkpoint import prune_checkpoints
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ops import ops_urls, start_trainer_ops
from swarmrl.node.trainer.service import serve
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    import hivemind

    from swarmrl.node.net.grpc_guard import StreamGuard

log = logging.getLogger(__name__)
COTRAINER_LOOK_S = 0.5   # how often the job records are read to follow cotrainers


class TrainerLoop:
    """The phases of the trainer's main loop: announce -> coordinate with cotrainers -> step."""

    def __init__(self, trainer: Trainer, dht: hivemind.DHT, identity: Identity, endpoint: str,
                 tls_cert_sha256: bytes = b"", statements: StatementGossip | None = None) -> None:
        self.trainer, self.dht, self.identity, self.endpoint = trainer, dht, identity, endpoint
        self.tls_cert_sha256, self.statements = tls_cert_sha256, statements
        self.maddrs = visible_maddrs(dht)
        self.last_announce = self.last_look = 0.0
        self.finished: set[str] = set()

    def announce(self, job: JobRuntime) -> None:
        """Put the job's signed record (version, announced endpoint and multiaddrs, pinned TLS
        certificate, cotrainers, head statement) in the DHT now, and the head statement this
        trainer serves peer to peer (`statement_gossip`: throttled while the job runs, at once
        when it is done)."""
        record = job.record(self.endpoint)
        record.tls_cert_sha256, record.maddrs[:] = self.tls_cert_sha256, self.maddrs
        announce_job(self.dht, self.identity, record)
        if self.statements is not None:
            self.statements.announce(job.job_id, self.identity.peer_id, int(record.statement_version),
                                     bytes(record.statement_sha256), job.statements.count(), force=job.done)

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
    preflight(cfg)   # what --dry-run checks: its DHT, gRPC and /metrics ports
    stop, identity = start_role("trainer", cfg.key, cfg.threads)
    dht = join_swarm(cfg.net)
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
    statements: StatementGossip | None = None
    try:
        statements = StatementGossip(dht, identity, statement_source(trainer, identity.peer_id),
                                     dialable=not cfg.net.client_mode)
        loop = TrainerLoop(trainer, dht, identity, endpoint, grpc_side.cert_sha256, statements)
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
        if statements is not None:
            statements.shutdown()
        trainer.ledger.close()
        dht.shutdown()


def statement_source(trainer: Trainer, peer_id: str) -> Source:
    """The trainer's own statements of the jobs it hosts, for `StatementGossip` to serve (a
    request for another trainer's chain, or a job not hosted here, gets none)."""
    def source(job_id: str, trainer_id: str, after_version: int, max_statements: int) -> list[pb.Signed]:
        job = trainer.jobs.get(job_id)
        if job is None or trainer_id != peer_id:
            return []
        return job.statements.fetch(after_version, max_statements)
    return source


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
