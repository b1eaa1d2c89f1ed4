"""The jobs one trainer process hosts, and the operations its gRPC service calls: submit a job,
admit a rollout batch, act on verdicts, serve a data set. `main.py` runs the process around it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarmrl.node.models.base_model import find_base_model_by_sha
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.trainer.faults import outer_drill, reducer_wrap
from swarmrl.node.trainer.job import JobRuntime, now_ms
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.red_team import drill_for
from swarmrl.node.trainer.retention import Retention
from swarmrl.protocol import signing
from swarmrl.protocol.admission import claimed_job_id
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec, job_id_from_body
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    import hivemind

    from swarmrl.node.net.grpc_guard import StreamGuard

log = logging.getLogger(__name__)


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
            job, submitter = signing.open_signed(envelope, signing.JOB, pb.Job)
            spec = JobSpec.from_json(job.spec_json)
            self._host(job_id, spec, bytes(job.dataset) or None, weight=min(spec.weight, self.weight_cap(submitter)))

    def weight_cap(self, submitter: str) -> float:
        """The highest job weight `submitter` (peer id) may ask of this trainer: its entry in
        `submitter_weight_caps`, else `max_job_weight`."""
        return self.cfg.submitter_weight_caps.get(submitter, self.cfg.max_job_weight)

    def _host(self, job_id: str, spec: JobSpec, dataset: bytes | None = None, weight: float | None = None) -> JobRuntime:
        path = find_base_model_by_sha(spec.base_model, spec.base_model_sha256, self.cfg.base_models, self.cfg.cache_dir)
        runtime = JobRuntime(job_id, spec, identity=self.identity, model_path=path, state_dir=self.cfg.state_dir,
                             dataset=dataset,
                             ledger=self.ledger, prompt_shard=self.cfg.prompt_shard,
                             probation_ms=int(self.cfg.probation_s * 1000) if self.cfg.trusted_validators else 0,
                             probation_last_chance=self.cfg.probation_last_chance,
                             wrap_reducer=reducer_wrap(self.cfg.fault), outer_drill=outer_drill(self.cfg.fault),
                             device=self.cfg.device,
                             ledger_keep_ms=int(self.cfg.ledger_keep_s * 1000), weight=weight,
                             statement_drill=drill_for(self.cfg.red_team, job_id))
        runtime.store.retention = Retention(self.cfg.keep_versions, self.cfg.keep_snapshots, spec.max_async_level)
        if self.dht is not None:
            runtime.attach_swarm(JobSwarm(
                self.dht, self.identity, job_id,
                allowed=set(self.cfg.cotrainers) if self.cfg.cotrainers is not None else None,
                matchmaking_s=self.cfg.averaging_matchmaking_s, timeout_s=self.cfg.averaging_timeout_s,
                sync=spec.sync_settings(), inner_steps=spec.inner_steps if spec.diloco else None))
        self.jobs[job_id] = runtime
        return runtime

    def submit_job(self, envelope: pb.Signed) -> pb.JobAck:
        """Verify a signed job, check its spec, weight (at most `weight_cap`) and base model, and
        start hosting it; a refusal is an ack with a one-line reason."""
        try:
            job, submitter = signing.open_signed(envelope, signing.JOB, pb.Job)
            spec = JobSpec.from_json(job.spec_json)
        except (signing.SignatureError, ValueError) as exc:
            return pb.JobAck(accepted=False, reason=f"invalid job: {exc}"[:500])
        job_id = job_id_from_body(envelope.body)
        if self.cfg.allowed_submitters is not None and submitter not in self.cfg.allowed_submitters:
            return pb.JobAck(job_id=job_id, accepted=False, reason=f"submitter {submitter} not allowed")
        cap = self.weight_cap(submitter)
        if spec.weight > cap:
            return pb.JobAck(job_id=job_id, accepted=False,
                             reason=f"job weight {spec.weight:g} is above this trainer's cap {cap:g} for submitter "
                                    f"{submitter} (max_job_weight, submitter_weight_caps)")
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
