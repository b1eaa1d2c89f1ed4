"""One audit of a trainer's credit books, over gRPC or from the public record (issue 27 item 3,
docs/CREDIT.md): what `swarmrl audit JOB` runs, `swarmrl up` at the end of every run, and a
validator in audit mode every few minutes (`validator/audits.py`, with its ladder as the
`recheck` of sampled batches).

It checks the trainer's statements as a chain, the signed update of the head version (and
`adapters` more) against its statement, a sample of credited batches against their workers'
signatures, and (given them) a worker's receipts. A credited batch the trainer no longer serves
is `unavailable` when its statement is older than `fresh_s` (compaction clears a finished batch
`ledger_keep_s` after it arrived, an hour by default), and `unknown_batch` when it is newer: a
batch credited minutes ago that the trainer can't serve was never there.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from swarmrl.protocol import audit, audit_sampling, credit
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    from swarmrl.protocol.identity import Identity


class AuditBooks(Protocol):
    """What an audit reads of a trainer's books: over gRPC (`client.AuditClient`) or from the
    public record (`public.PublicBooks`: the statements from any holder, peer to peer)."""

    def status(self, job_id: str) -> pb.JobStatus:
        """The job's status (`trainer_id`, `spec_json`; state "unknown": not hosted)."""

    def statements(self, job_id: str) -> list[pb.Signed]:
        """Every signed statement of the trainer's chain of the job, ascending versions."""

    def batches(self, job_id: str, batch_ids: Iterable[str]) -> dict[str, pb.AdmittedBatch] | None:
        """The named credited batches (hex ids) the trainer still keeps, by the id it claims;
        None when nobody can serve batches now (the trainer is gone): none is checked."""

    def update_header(self, job_id: str, version: int, trainer_id: str) -> pb.AdapterUpdate | None:
        """The signed update header that produced `version`, or None when no longer kept."""



@dataclass(frozen=True)
class AuditPlan:
    """How much one audit checks.

    sample: credited batches fetched and checked (0: all); adapters: versions besides the head
    whose signed update is checked against its statement (None: every one in the window);
    seed: the sample's (None: random); fresh_s: seconds within which a credited batch must
    still be served (see the module); window_s: draw only among the statements of the last
    window_s seconds (0: the whole chain; the chain is checked whole either way). The draw is
    `protocol.audit_sampling.pick_checks`, the simulator's too (docs/CREDIT.md section 6)."""

    sample: int = 64
    adapters: int | None = 1
    seed: int | None = None
    fresh_s: float = audit.FRESH_S
    window_s: float = 0.0


class AuditUnreachable(ValueError):
    """The trainer could not be reached, or does not host the job."""


Recheck = Callable[[pb.ContributionStatement, pb.CreditedBatch, pb.AdmittedBatch], list[pb.AuditFinding]]
"""A deeper check of one sampled credited batch that passed the books' checks (the validator's
ladder: `validator.audits`): the statement that credits it, the credit, the batch as served;
returns findings (`audit.FAILED_RECHECK`). It may raise `RecheckUnavailable` when it can't judge
(e.g. the adapter the batch was sampled with is no longer kept): the batch then counts as
unavailable, not as a finding."""


class RecheckUnavailable(Exception):
    """A recheck that could not judge its batch (not a finding)."""


def audit_job(client: AuditBooks, job_id: str, plan: AuditPlan, auditor: Identity, *, trainer_id: str = "",
              receipts: Sequence[pb.Signed] | None = None, recheck: Recheck | None = None,
              record: pb.JobRecord | None = None, on_chain: Callable[[list[pb.Signed]], None] | None = None,
              ) -> pb.AuditReport:
    """Audit `job_id` at the trainer behind `client` (its peer id `trainer_id`; default: the one
    its status names), signed later by `auditor`. Returns the report (its findings empty when the
    books add up). `recheck`: a deeper check of each sampled batch that passes the books' checks
    (`Recheck`; the validator's ladder in audit mode). `record`: the trainer's signed job record,
    read before the books: the head statement it names must be in the chain
    (`audit.check_record`; not checked when the chain served ends before it: a lagging mirror).
    `on_chain`: given the statements that verified as a chain (a prefix of what was served; a
    mirror keeps them to serve).

    Raises:
        AuditUnreachable: the trainer does not host the job.
        grpc.RpcError: the trainer can't be reached.
    """
    status = client.status(job_id)
    if status.state == "unknown":
        raise AuditUnreachable(f"the trainer does not host job {job_id!r}")
    envelopes = client.statements(job_id)
    trainer_id = trainer_id or status.trainer_id
    statements, findings = audit.check_chain(envelopes, job_id=job_id, trainer_id=trainer_id)
    if on_chain is not None and statements:
        on_chain(list(envelopes[:len(statements)]))
    heads = {audit.statement_version(e): credit.statement_sha256(e) for e in envelopes}
    if record is not None and record.statement_version <= max(heads, default=0):
        findings += audit.check_record(statements, heads, int(record.statement_version), bytes(record.statement_sha256))
    now_ms = int(time.time() * 1000)
    since_ms = now_ms - int(plan.window_s * 1000) if plan.window_s > 0 else None
    checks = audit_sampling.pick_checks(
        [s.version for s in statements], [len(s.batches) for s in statements], random.Random(plan.seed),
        sample=plan.sample, adapters=plan.adapters,
        first=audit_sampling.window_start([s.created_ms for s in statements], since_ms))
    findings += _adapter_findings(client, job_id, trainer_id, statements, checks.adapter_versions)
    sample = [(statements[i], statements[i].batches[j]) for i, j in checks.batches]
    answer = client.batches(job_id, [bytes(b.batch_id).hex() for _, b in sample])
    checked = sample if answer is not None else []   # None: nobody serves batches now (the trainer is gone)
    served = answer or {}
    fresh_ms = now_ms - int(plan.fresh_s * 1000)
    unavailable = len(sample) - len(checked)
    for st, b in checked:
        got = served.get(bytes(b.batch_id).hex())
        if got is not None:
            found = audit.check_batch(job_id, st.version, b, got)
            if not found and recheck is not None:
                try:
                    found = recheck(st, b, got)
                except RecheckUnavailable:
                    unavailable += 1
                    continue
            findings += found
        elif st.created_ms >= fresh_ms:
            findings.append(audit.finding(audit.UNKNOWN_BATCH, version=st.version, peer_id=b.peer_id,
                                          batch_id=bytes(b.batch_id).hex(),
                                          detail=f"credited {(now_ms - st.created_ms) / 1000:.0f} s ago, "
                                                 "and the trainer does not serve it"))
        else:
            unavailable += 1   # compacted (older than the trainer's ledger_keep_s)
    checked_receipts = pending = 0
    if receipts is not None:
        spec = JobSpec.from_json(status.spec_json)
        final = spec.steps if statements and statements[-1].version >= spec.steps else None
        found, checked_receipts, pending = audit.check_receipts(
            receipts, statements, job_id=job_id, trainer_id=trainer_id, max_async_level=spec.max_async_level,
            final_version=final)
        findings += found
    return audit.audit_report(job_id, trainer_id, statements, heads, findings,
                              batches_checked=len(sample) - unavailable, batches_unavailable=unavailable,
                              receipts_checked=checked_receipts, receipts_pending=pending,
                              auditor_id=auditor.peer_id, created_ms=now_ms)


def _adapter_findings(client: AuditBooks, job_id: str, trainer_id: str,
                      statements: Sequence[pb.ContributionStatement], versions: Sequence[int]) -> list[pb.AuditFinding]:
    """Check the signed updates of `versions` against their statements (`credit.check_adapter`);
    versions whose update is no longer kept are skipped."""
    by_version = {s.version: s for s in statements}
    out: list[pb.AuditFinding] = []
    for v in versions:
        header = client.update_header(job_id, v, trainer_id)
        if header is None:
            continue
        try:
            credit.check_adapter(by_version[v], header)
        except credit.CreditError as exc:
            out.append(audit.finding(exc.reason, version=v, detail=exc.detail))
    return out
