"""The validator's network side: follow jobs' trainers, judge admitted batches, report verdicts.

The trainer of each job is reached through a `ValidatorTrainer` client (`node.net.trainer_client`)
that `connect` makes from the job's record: over gRPC by default (`grpc_wire.connect`: every call
names this validator in `swarmrl-peer` metadata and is retried with backoff when the trainer
refuses it as overloaded or can't be reached), or in process (`node.local.inprocess`).

One round per job: SampleAdmitted(after the saved cursor) -> GetJobStatus (the head, read after
the batches were admitted) -> per batch: `Validator.validate_batch` -> sign a `VerdictReport`
(domain "verdicts") -> ReportVerdicts -> advance the cursor. The cursor moves only after the
report went out, so a crash or an unreachable trainer means the batch is judged again, never
skipped. One base model is loaded once per distinct weights hash (normally one), with one adapter
slot per job; adapter snapshots are shared through one LRU.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from swarmrl.node.audit.books import Recheck, RecheckUnavailable
from swarmrl.node.inference import build_backend
from swarmrl.node.models.base_model import default_cache_dir, find_base_model_by_sha
from swarmrl.node.net import grpc_wire, tls
from swarmrl.node.net.call_status import code_name
from swarmrl.node.net.trainer_client import ValidatorTrainer
from swarmrl.node.runtime.config import ValidatorConfig
from swarmrl.node.swarm.datasets import DatasetStore, DatasetUnavailable, fetch_dataset
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.protocol import audit, signing
from swarmrl.protocol.envs import job_environment
from swarmrl.protocol.envs.base import Environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.adapters import SnapshotCache, TrainerAdapters
from swarmrl.validator.audits import AuditMode
from swarmrl.validator.checks import LogprobTolerance
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.sampling import load_or_create_key
from swarmrl.validator.seen import SeenStore
from swarmrl.validator.stats import VerdictStats
from swarmrl.validator.validator import Validator, ValidatorSettings

log = logging.getLogger(__name__)
MAX_BATCHES = 16           # admitted batches asked per round and job
MAX_VERDICTS_PER_REPORT = 512
Connect = Callable[[pb.JobRecord], ValidatorTrainer]
"""A client of the trainer that signed a record (`grpc_wire.connect` by default; raises
tls.PinError, or ValueError for a record it can't connect to)."""


def sign_report(identity: Identity, job_id: str, verdicts: list[pb.Verdict], now_ms: int) -> pb.Signed:
    """A signed `VerdictReport` (domain "verdicts") of one job's verdicts."""
    report = pb.VerdictReport(job_id=job_id, verdicts=verdicts, created_ms=now_ms)
    return signing.sign(identity, signing.VERDICTS, report)


@dataclass
class JobWatch:
    """A job the validator follows: its record, spec, trainer client and adapter source."""

    record: VerifiedRecord
    spec: JobSpec
    trainer: ValidatorTrainer
    adapters: TrainerAdapters
    model_sha: str
    refused_reported: bool = False
    env: Environment | None = None

    @classmethod
    def open(cls, record: VerifiedRecord, trainer: ValidatorTrainer, *, cache: SnapshotCache) -> JobWatch:
        """Follow the job of `record` through `trainer`, the client of the trainer that signed it
        (`grpc_wire.connect`, or in process); the watch closes it, also when opening fails.
        Raises ValueError when the record's spec does not parse, names an environment that is
        not installed here, or a data set no source served."""
        r = record.record
        try:
            spec = JobSpec.from_json(r.spec_json)
            dataset = None
            if spec.dataset is not None:   # by content address from the trainer, verified chunk by chunk
                try:
                    dataset = fetch_dataset(spec.dataset, DatasetStore(default_cache_dir() / "datasets"),
                                            trainer=trainer, trainer_name=r.trainer_id)
                except DatasetUnavailable as exc:
                    raise ValueError(str(exc)) from None
            env = job_environment(spec, dataset)  # installed here (or the data set's bytes), or ValueError
        except ValueError:
            trainer.close()
            raise
        adapters = TrainerAdapters(r.job_id, record.trainer_public_key, trainer, cache)
        return cls(record, spec, trainer, adapters, r.base_model_sha256.hex(), env=env)

    @property
    def job_id(self) -> str:
        """The followed job's id."""
        return self.record.record.job_id

    @property
    def trainer_id(self) -> str:
        """Peer id of the trainer whose record this watch follows."""
        return self.record.trainer_id

    def sample(self, after_seq: int) -> list[pb.AdmittedBatch]:
        """Up to MAX_BATCHES admitted batches after ledger sequence `after_seq`, oldest first.

        Raises:
            grpc.RpcError: the trainer could not be reached (or did not answer in time);
                `grpc_retry.GaveUp` (one) when it still refused or was unreachable after every retry.
        """
        return self.trainer.sample_admitted(pb.SampleRequest(job_id=self.job_id, after_seq=after_seq,
                                                             max_batches=MAX_BATCHES))

    def head_version(self) -> int:
        """The job's policy version at the trainer now.

        Raises:
            grpc.RpcError: the trainer could not be reached (or did not answer in time);
                `grpc_retry.GaveUp` (one) when it still refused or was unreachable after every retry.
        """
        return int(self.trainer.job_status(pb.JobStatusRequest(job_id=self.job_id)).policy_version)

    def report(self, envelope: pb.Signed) -> pb.VerdictAck:
        """Send a signed verdict report to the trainer; returns its acknowledgement.

        Raises:
            grpc.RpcError: the trainer could not be reached (or did not answer in time);
                `grpc_retry.GaveUp` (one) when it still refused or was unreachable after every retry.
        """
        return self.trainer.report_verdicts(envelope)

    def close(self) -> None:
        """Close the client of the trainer."""
        self.trainer.close()


class ValidatorService:
    """Everything a validator process holds between rounds (stores, models, followed jobs)."""

    def __init__(self, cfg: ValidatorConfig, identity: Identity, connect: Connect | None = None) -> None:
        self.cfg, self.identity = cfg, identity
        self.connect: Connect = connect or functools.partial(grpc_wire.connect, max_message_mb=cfg.max_message_mb,
                                                             peer_id=identity.peer_id)
        state = Path(cfg.state_dir)
        self.seen = SeenStore(state / "seen.sqlite")
        self.reputation = Reputation(state / "reputation.sqlite")
        self.sampling_key = load_or_create_key(state / "sampling.key")
        self.settings = ValidatorSettings(
            base_rate=cfg.sample_rate,
            logprob=None if cfg.logprob_tolerance is None else LogprobTolerance.from_mean(cfg.logprob_tolerance),
            grade_timeout_s=cfg.grade_timeout_s,
        )
        self.cache = SnapshotCache()
        self.validators: dict[str, Validator] = {}   # by base-model weights sha256
        self.unservable: set[str] = set()           # base models (sha) this validator can't load
        self.watches: dict[tuple[str, str], JobWatch] = {}
        self.unusable: set[tuple[str, str]] = set()   # jobs whose record this validator can't use
        self.stats = VerdictStats()                   # groups checked, verdicts sent (validator.metrics)
        self.audits: AuditMode | None = None          # audit mode (validator/audits.py), when configured

    def close(self) -> None:
        """Close every watch, unload the models, and close the seen and reputation stores."""
        for watch in self.watches.values():
            watch.close()
        for v in self.validators.values():
            v.close()
        self.seen.close()
        self.reputation.close()

    # ---- models

    def validator_for(self, record: pb.JobRecord) -> Validator | None:
        """The validator holding the job's base model (loaded on first use), or None when this
        machine can't provide those exact weights."""
        sha = record.base_model_sha256.hex()
        if sha in self.validators:
            return self.validators[sha]
        if sha in self.unservable:
            return None
        try:
            path = find_base_model_by_sha(record.base_model, sha, self.cfg.base_models, self.cfg.cache_dir)
        except (ValueError, RuntimeError) as exc:
            log.warning("can't validate jobs on %s: %s", record.base_model, exc)
            self.unservable.add(sha)
            return None
        backend = build_backend("hf", path, device=self.cfg.device)   # rescoring runs one prefill on `backend.activated`'s model
        self.validators[sha] = Validator(backend, seen=self.seen, reputation=self.reputation,
                                         sampling_key=self.sampling_key, settings=self.settings)
        log.info("loaded %s for validation", record.base_model)
        return self.validators[sha]

    # ---- audits

    def recheck_for(self, rec: VerifiedRecord) -> Recheck | None:
        """The ladder as an audit's recheck of the sampled credited batches of `rec`'s job
        (`node.audit.books.Recheck`), or None when this validator can't judge the job (its base
        model or environment is not here)."""
        judged = self.judge(rec)
        if judged is None:
            return None
        validator, watch = judged
        if watch.env is not None:
            validator.add_env(watch.spec, watch.env)
        return functools.partial(_recheck, validator, watch)

    # ---- rounds

    def poll(self, records: list[VerifiedRecord], stop: threading.Event | None = None) -> int:
        """One round over every job in `records`; returns the number of verdicts sent.

        With `stop` set (SIGTERM), the round ends after the batch being judged: each judged batch's
        verdicts are sent and its cursor stored before the next one, so nothing is lost and a
        round of many batches (seconds each at a load of 8) can't outlast the shutdown grace."""
        sent = 0
        for rec in records:
            if stop is not None and stop.is_set():
                break
            judged = self.judge(rec)
            if judged is None:
                continue
            validator, watch = judged
            try:
                n, caught_up = self.round(watch, validator, stop)
            except grpc.RpcError as exc:
                log.warning("job %s: trainer %s unreachable (%s)", watch.job_id[:12], rec.record.endpoint, exc.code())
                continue
            sent += n
            if caught_up and rec.record.done:
                validator.forget_job(watch.job_id)
        live = {(rec.record.job_id, rec.trainer_id) for rec in records}
        for key in [k for k in self.watches if k not in live]:  # records expired: the trainer is gone
            self.watches.pop(key).close()
        return sent

    def judge(self, rec: VerifiedRecord) -> tuple[Validator, JobWatch] | None:
        """The validator holding `rec`'s base model and the job's open watch, or None when this
        machine can't judge the job (the record is unusable, or its base model is not here)."""
        key = (rec.record.job_id, rec.trainer_id)
        validator = None if key in self.unusable else self.validator_for(rec.record)
        watch = self.watch(rec) if validator is not None else None
        return None if watch is None or validator is None else (validator, watch)

    def watch(self, rec: VerifiedRecord) -> JobWatch | None:
        """The job's open watch (reopened when the trainer moved), or None for an unusable record."""
        key = (rec.record.job_id, rec.trainer_id)
        watch = self.watches.get(key)
        if watch is not None and watch.record.record.endpoint == rec.record.endpoint:
            watch.record = rec
            return watch
        if watch is not None:
            self.watches.pop(key).close()
        try:
            watch = JobWatch.open(rec, self.connect(rec.record), cache=self.cache)
        except ValueError as exc:
            log.warning("job %s: can't validate it: %s", key[0][:12], str(exc)[:200])
            self.unusable.add(key)
            return None
        except tls.PinError as exc:   # unreachable now, or an impostor: try again next round
            log.warning("job %s: %s", key[0][:12], exc)
            return None
        self.watches[key] = watch
        return watch

    def round(self, watch: JobWatch, validator: Validator, stop: threading.Event | None = None) -> tuple[int, bool]:
        """Judge the next admitted batches of one job, ending early once `stop` is set.
        Returns (verdicts sent, caught up)."""
        if watch.env is not None:
            validator.add_env(watch.spec, watch.env)
        batches = watch.sample(self.seen.cursor(watch.job_id, watch.trainer_id))
        if not batches:
            return 0, True
        head = watch.head_version()
        sent = 0
        for admitted in batches:
            if stop is not None and stop.is_set():
                return sent, False
            verdicts = validator.validate_batch(admitted, watch.spec, job_id=watch.job_id, head_version=head,
                                                adapters=watch.adapters)
            self.stats.groups[watch.job_id] += len(admitted.admitted_prompt_indices)
            sent += self.report(watch, verdicts)
            self.seen.set_cursor(watch.job_id, watch.trainer_id, admitted.seq)
        return sent, len(batches) < MAX_BATCHES

    def report(self, watch: JobWatch, verdicts: list[pb.Verdict]) -> int:
        """Sign and send verdicts (in reports of at most MAX_VERDICTS_PER_REPORT)."""
        for lo in range(0, len(verdicts), MAX_VERDICTS_PER_REPORT):
            part = verdicts[lo: lo + MAX_VERDICTS_PER_REPORT]
            ack = watch.report(sign_report(self.identity, watch.job_id, part, int(time.time() * 1000)))
            if ack.reason and not watch.refused_reported:
                log.warning("job %s: trainer refused our verdicts: %s", watch.job_id[:12], ack.reason)
                watch.refused_reported = True
            for peer in ack.banned:
                log.warning("job %s: trainer banned %s on our verdicts", watch.job_id[:12], peer[:12])
        failed = sum(not v.passed for v in verdicts)
        self.stats.sent(watch.job_id, verdicts)
        if verdicts:
            log.info("job %s: %d verdicts (%d failed)", watch.job_id[:12], len(verdicts), failed)
        return len(verdicts)


def _recheck(validator: Validator, watch: JobWatch, statement: pb.ContributionStatement, credited: pb.CreditedBatch,
             admitted: pb.AdmittedBatch) -> list[pb.AuditFinding]:
    """Every credited group of one batch through the ladder (`Validator.validate_batch`, audit:
    nothing recorded); one `failed_recheck` finding naming the groups that fail.

    Raises:
        RecheckUnavailable: the trainer can't serve what the ladder needs (e.g. the adapter the
            batch was sampled with is no longer kept)."""
    try:
        verdicts = validator.validate_batch(admitted, watch.spec, job_id=watch.job_id, head_version=statement.version,
                                            adapters=watch.adapters, audit=True)
    except grpc.RpcError as exc:
        raise RecheckUnavailable(f"the trainer could not serve what the recheck needs ({code_name(exc)})") from exc
    credited_idx = set(credited.prompt_indices)
    failed = [v for v in verdicts if not v.passed and v.prompt_index in credited_idx]
    if not failed:
        return []
    detail = "; ".join(f"prompt {v.prompt_index}: {v.check} {v.detail}" for v in failed[:3])
    return [audit.finding(audit.FAILED_RECHECK, version=statement.version, peer_id=credited.peer_id,
                          batch_id=bytes(credited.batch_id).hex(),
                          detail=f"{len(failed)} of {len(credited_idx)} credited groups fail: {detail}"[:400])]
