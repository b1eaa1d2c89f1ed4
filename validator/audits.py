"""The validator's audit mode (issue 27 item 3, docs/CREDIT.md section 3): every `audit_every_s`
seconds, audit the credit books of each job whose record the validator reads, sign the report
with the validator's key and publish it in the swarm's DHT (`swarm.audit_records`), where
`swarmrl audit JOB --published` and anyone else reads it.

One audit is `node.audit.books.audit_job` on the windowed rule (`docs/CREDIT.md` section 6): the
whole chain is checked, and the sample is drawn among the statements of the last `audit_every_s`
seconds (every signed update in that window, `sample` credited batches), so each audit costs the
same however long the job has run, and consecutive audits cover the whole run. Each sampled
credited batch that passes the books' checks also goes through the validator's ladder
(re-grading, recomputed log-probs of the sampled tokens, ...: `ValidatorService.recheck_for`), with
every credited group checked and nothing recorded against the worker: a trainer that credits
made-up rollouts, its own sybils' included, is named `failed_recheck`. A validator
in audit mode need not be in any trainer's `trusted_validators`: a report is evidence anyone can
re-check, and trainers still act only on their trusted validators' verdicts.

A trainer that can't be reached, or no longer hosts the job, is counted (`unreachable`) and
asked again at the next audit; nothing here stops the validator's rounds. The head statement the
trainer's job record names must be in the chain it serves (`record_mismatch`), and each chain
that verifies is mirrored (`validator/mirror.py`): served peer to peer, so the job's public
record outlives its trainer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import grpc

from swarmrl.node.audit.books import AuditPlan, AuditUnreachable, Recheck, audit_job
from swarmrl.node.audit.client import AuditClient
from swarmrl.node.net import tls
from swarmrl.node.net.call_status import code_name
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.protocol.audit import sign_report
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.mirror import ChainMirror

log = logging.getLogger(__name__)

Publish = Callable[[pb.Signed], bool]
"""Store a signed audit report where others read it (the DHT: `swarm.audit_records.publish_report`);
returns whether it was stored."""
ClientFor = Callable[[pb.JobRecord], AuditClient]
"""The audit client of the trainer that signed a record (default: gRPC to its endpoint, TLS pinned)."""
RecheckFor = Callable[[VerifiedRecord], Recheck | None]
"""The deeper check of a job's sampled credited batches (the validator's ladder:
`ValidatorService.recheck_for`), or None where this validator can't judge the job."""


def grpc_client(record: pb.JobRecord) -> AuditClient:
    """An `AuditClient` of the record's trainer (its endpoint; TLS pinned to its certificate if any).

    Raises:
        tls.PinError: the record names a certificate the endpoint does not present.
    """
    return AuditClient(record.endpoint, bytes(record.tls_cert_sha256))


@dataclass
class AuditResult:
    """What one audit of one job found: the signed report (None when the trainer was unreachable)."""

    job_id: str
    trainer_id: str
    signed: pb.Signed | None
    findings: int = 0
    published: bool = False
    error: str = ""


class AuditMode:
    """Periodic audits of the jobs a validator reads (see the module docstring).

    every_s: seconds between audits (> 0), also the window the sample is drawn from;
    sample: credited batches checked per audit and job (0: all in the window); publish: where signed reports go (None:
    kept local, counted only); mirror: keeps each chain that verified and serves it peer to peer
    (None: no mirror); clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: every_s <= 0 or sample < 0.
    """

    def __init__(self, identity: Identity, every_s: float, *, sample: int = 64, publish: Publish | None = None,
                 client_for: ClientFor = grpc_client, recheck_for: RecheckFor | None = None,
                 mirror: ChainMirror | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if every_s <= 0 or sample < 0:
            raise ValueError(f"audit_every_s must be > 0 and audit_sample >= 0, got {every_s} and {sample}")
        self.identity, self.every_s, self.publish = identity, every_s, publish
        self.plan = AuditPlan(sample=sample, adapters=None, window_s=every_s)
        self.client_for, self.recheck_for, self.mirror, self.clock = client_for, recheck_for, mirror, clock
        self.next_at = clock()                  # the first audit runs at the first chance
        self.counts: Counter[str] = Counter()   # audits by result: clean, findings, unreachable
        self.findings: Counter[str] = Counter()  # findings by reason
        self.published = 0

    def due(self) -> bool:
        """Whether the next audit is due now."""
        return self.clock() >= self.next_at

    def run(self, records: list[VerifiedRecord], stop: threading.Event | None = None) -> list[AuditResult]:
        """Audit every (job, trainer) of `records` once and schedule the next audit `every_s` on;
        with `stop` set (SIGTERM) no further job is audited (each audit's calls are bounded by
        the client's timeout)."""
        self.next_at = self.clock() + self.every_s
        seen: set[tuple[str, str]] = set()
        out = []
        for rec in records:
            if stop is not None and stop.is_set():
                break
            key = (rec.record.job_id, rec.trainer_id)
            if key in seen:
                continue
            seen.add(key)
            out.append(self.audit_one(rec))
        return out

    def audit_one(self, rec: VerifiedRecord) -> AuditResult:
        """Audit one job at the trainer that signed `rec`; never raises for an unreachable trainer."""
        job_id, trainer_id = rec.record.job_id, rec.trainer_id
        try:
            recheck = self.recheck_for(rec) if self.recheck_for is not None else None
            client = self.client_for(rec.record)
            try:
                keep = None if self.mirror is None else partial(self.mirror.keep, job_id, trainer_id)
                report = audit_job(client, job_id, self.plan, self.identity, trainer_id=trainer_id, recheck=recheck,
                                   record=rec.record, on_chain=keep)
            finally:
                client.close()
        except (grpc.RpcError, AuditUnreachable, tls.PinError, ConnectionError) as exc:
            self.counts["unreachable"] += 1
            reason = code_name(exc) if isinstance(exc, grpc.RpcError) else str(exc)
            log.warning("job %s: audit of trainer %s failed: %s", job_id[:12], trainer_id[:12], reason[:200])
            return AuditResult(job_id, trainer_id, None, error=reason)
        signed = sign_report(self.identity, report)
        n = len(report.findings)
        self.counts["findings" if n else "clean"] += 1
        self.findings.update(f.reason for f in report.findings)
        if n:
            log.warning("job %s: audit of trainer %s: %d finding(s): %s", job_id[:12], trainer_id[:12], n,
                        "; ".join(f"{f.reason} at version {f.version}: {f.detail}"[:200] for f in report.findings[:5]))
        else:
            log.info("job %s: audit of trainer %s clean (%d statements, %d batches checked)", job_id[:12],
                     trainer_id[:12], report.statements, report.batches_checked)
        published = False
        if self.publish is not None:
            try:
                published = self.publish(signed)
            except Exception as exc:  # noqa: BLE001 - the DHT can fail; the next audit publishes again
                log.warning("job %s: publishing the audit report failed: %r", job_id[:12], exc)
            self.published += published
        return AuditResult(job_id, trainer_id, signed, findings=n, published=published)
