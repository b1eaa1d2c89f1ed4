"""Audits of a trainer's books (issue 27 item 3, docs/CREDIT.md): pure checks of its signed
contribution statements against the rollout batches its workers signed and the receipts it
signed them. Anyone can run them (`swarmrl audit JOB`); the inputs are all signed by someone
else than the auditor, so a finding is evidence, not an opinion.

- `check_chain`: the trainer's statements, one by one and as a chain (`protocol.credit`).
- `check_batch`: a credited batch, as the trainer serves it (`SampleRequest.batch_ids`): the
  batch its id names, signed by the worker it is credited to, for the job, its credited indices
  among its groups and the trainer's admitted ones, its token count recomputed.
- `check_receipts`: a worker's receipts: each admitted group that can no longer be trained
  (`due`) is credited or listed as dropped in the chain; else `omitted_group`.

Each check returns `AuditFinding`s with a named reason (`REASONS`); `audit_report` and
`sign_report` make the signed verdict (domain "audit-report").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from swarmrl.protocol import credit, receipts, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

UNKNOWN_BATCH = "unknown_batch"    # the trainer can't serve a credited batch by its id, or serves another one
FORGED_BATCH = "forged_batch"      # a credited batch whose worker signature does not verify
WRONG_WORKER = "wrong_worker"      # credited to a peer that did not sign the batch
NOT_ADMITTED = "not_admitted"      # credited indices not among the batch's groups or the admitted ones
OMITTED_GROUP = "omitted_group"    # a receipted admitted group neither credited nor dropped once due
FORGED_RECEIPT = "forged_receipt"  # a receipt not signed by the job's trainer, or not about the job
RECORD_MISMATCH = "record_mismatch"  # the job record's head statement is not in the chain served
FAILED_RECHECK = "failed_recheck"  # a credited batch whose groups fail a validator's ladder (re-grade, log-probs, ...)
STEP_MISMATCH = "step_mismatch"    # a published version that is not one step on its credited groups (a replay)
FRESH_S = 1800.0   # half the trainer's default ledger_keep_s: a batch credited since then must still be served
REASONS = credit.REASONS | {UNKNOWN_BATCH, FORGED_BATCH, WRONG_WORKER, NOT_ADMITTED, OMITTED_GROUP, FORGED_RECEIPT,
                            RECORD_MISMATCH, FAILED_RECHECK, STEP_MISMATCH}


def finding(reason: str, *, version: int = 0, peer_id: str = "", batch_id: str = "", detail: str = "") -> pb.AuditFinding:
    """One finding; `batch_id` in hex."""
    assert reason in REASONS, reason
    return pb.AuditFinding(reason=reason, version=version, peer_id=peer_id, batch_id=batch_id, detail=detail[:300])


def check_chain(envelopes: Sequence[pb.Signed], *, job_id: str, trainer_id: str,
                ) -> tuple[list[pb.ContributionStatement], list[pb.AuditFinding]]:
    """Verify a trainer's whole chain (`credit.verify_chain`). Returns (the statements verified,
    in order, up to the first failure; the failure as a finding, if any)."""
    try:
        return credit.verify_chain(envelopes, job_id=job_id, trainer_id=trainer_id), []
    except credit.CreditError as exc:
        before = [e for e in envelopes if statement_version(e) < exc.version] if exc.version else \
            envelopes[:_first_unreadable(envelopes, job_id, trainer_id)]
        good = credit.verify_chain(before, job_id=job_id, trainer_id=trainer_id)
        return good, [finding(exc.reason, version=exc.version or _version_after(good),
                              detail=exc.detail or str(exc))]


def _first_unreadable(envelopes: Sequence[pb.Signed], job_id: str, trainer_id: str) -> int:
    """Index of the first statement refused on its own (a failure without a version: a bad
    signature, or a body that does not parse); len(envelopes) if none is."""
    for i, env in enumerate(envelopes):
        try:
            credit.verify_statement(env, job_id=job_id, trainer_id=trainer_id)
        except credit.CreditError:
            return i
    return len(envelopes)


def _version_after(good: Sequence[pb.ContributionStatement]) -> int:
    """The version an unreadable statement after the verified run `good` stands for."""
    return good[-1].version + 1 if good else 0


def statement_version(envelope: pb.Signed) -> int:
    """The version a signed statement claims; 0 when its body does not parse (a trainer can
    serve anything)."""
    try:
        return int(pb.ContributionStatement.FromString(envelope.body).version)
    except Exception:  # noqa: BLE001 - an unparseable body has no version
        return 0


def check_record(statements: Sequence[pb.ContributionStatement], heads: dict[int, bytes],
                 record_version: int, record_sha256: bytes) -> list[pb.AuditFinding]:
    """The head statement a signed job record names (version, sha256) must be in the chain
    served (`heads`: version -> sha256 of each statement served). Version 0: none named yet."""
    if record_version == 0 or heads.get(record_version) == record_sha256:
        return []
    return [finding(RECORD_MISMATCH, version=record_version,
                    detail=f"the job record names statement {record_sha256.hex()[:12]} of version {record_version}, "
                           f"the trainer served {heads.get(record_version, b'').hex()[:12] or 'none'}")]


def check_batch(job_id: str, version: int, credited: pb.CreditedBatch, served: pb.AdmittedBatch | None,
                ) -> list[pb.AuditFinding]:
    """Check one credited batch of statement `version` against the batch the trainer served for
    its id (`served`; None: not served). See the module docstring."""
    bid = bytes(credited.batch_id).hex()

    def bad(reason: str, detail: str) -> list[pb.AuditFinding]:
        return [finding(reason, version=version, peer_id=credited.peer_id, batch_id=bid, detail=detail)]

    if served is None or signing.envelope_id(served.batch) != bid:
        return bad(UNKNOWN_BATCH, "the trainer did not serve the credited batch by its id")
    try:
        batch, signer = signing.open_signed(served.batch, signing.ROLLOUT_BATCH, pb.RolloutBatch)
    except signing.SignatureError as exc:
        return bad(FORGED_BATCH, str(exc))
    if signer != credited.peer_id or batch.peer_id != signer:
        return bad(WRONG_WORKER, f"credited to {credited.peer_id[:16]}, signed by {signer[:16]}")
    if batch.job_id != job_id:
        return bad(credit.WRONG_JOB, f"the batch is of job {batch.job_id[:16]!r}")
    groups = {g.prompt_index: g for g in batch.groups}
    wanted = list(credited.prompt_indices)
    missing = [i for i in wanted if i not in groups or i not in set(served.admitted_prompt_indices)]
    if missing:
        return bad(NOT_ADMITTED, f"prompt indices {missing[:8]} are not admitted groups of the batch")
    tokens = sum(credit.model_tokens(groups[i]) for i in wanted)
    if tokens != credited.tokens:
        return bad(credit.COUNTS_MISMATCH, f"credited {credited.tokens} tokens, the groups carry {tokens}")
    return []


def due(policy_version: int, head_version: int, max_async_level: int, final_version: int | None) -> bool:
    """Whether a group admitted at job version `policy_version` must be in the chain by the
    statement of `head_version`: by version p + A + 2 it was trained or dropped as stale (a step
    drops stale groups before it trains: `JobRuntime.ready`); in a finished job (statement of its
    last version `final_version` present) every admitted group is: the last step lists the
    groups still pending as dropped, and a done job admits no batch."""
    if final_version is not None and head_version >= final_version and policy_version <= final_version:
        return True
    return head_version >= policy_version + max_async_level + 2


def check_receipts(envelopes: Iterable[pb.Signed], statements: Sequence[pb.ContributionStatement], *, job_id: str,
                   trainer_id: str, max_async_level: int, final_version: int | None,
                   ) -> tuple[list[pb.AuditFinding], int, int]:
    """Check a worker's signed receipts of the job against the chain. Returns (findings,
    receipts checked, receipted groups not due yet). A receipt whose signature does not verify
    (or that does not parse) is refused (`forged_receipt`): it proves nothing; a receipt of
    another job, or signed by another key (a cotrainer's), is not this chain's and is skipped."""
    stated: set[tuple[bytes, int]] = {(bytes(e.batch_id), i) for st in statements
                                      for e in credit.entries(st) for i in e.prompt_indices}
    head = statements[-1].version if statements else 0
    findings, checked, pending = [], 0, 0
    for env in envelopes:
        try:
            r, signer = receipts.open_receipt(env)
        except receipts.ReceiptError as exc:
            findings.append(finding(FORGED_RECEIPT, detail=str(exc)))
            continue
        if r.job_id != job_id or signer != trainer_id:   # another job's, or another trainer's (a cotrainer's)
            continue
        checked += 1
        for i in r.admitted:
            if (bytes.fromhex(r.batch_id), i) in stated:
                continue
            if not due(r.policy_version, head, max_async_level, final_version):
                pending += 1
                continue
            findings.append(finding(OMITTED_GROUP, version=head, peer_id=r.peer_id, batch_id=r.batch_id,
                                    detail=f"prompt {i}, admitted at version {r.policy_version}, is in no "
                                           f"statement up to version {head}"))
    return findings, checked, pending


def audit_report(job_id: str, trainer_id: str, statements: Sequence[pb.ContributionStatement], heads: dict[int, bytes],
                 findings: Sequence[pb.AuditFinding], *, batches_checked: int, batches_unavailable: int,
                 receipts_checked: int, receipts_pending: int, auditor_id: str, created_ms: int) -> pb.AuditReport:
    """The verdict of one audit (what `sign_report` signs)."""
    head = statements[-1].version if statements else 0
    return pb.AuditReport(job_id=job_id, trainer_id=trainer_id, statements=len(statements), head_version=head,
                          head_sha256=heads.get(head, b""), batches_checked=batches_checked,
                          receipts_checked=receipts_checked, findings=list(findings), created_ms=created_ms,
                          batches_unavailable=batches_unavailable, receipts_pending=receipts_pending,
                          auditor_id=auditor_id)


def sign_report(identity: Identity, report: pb.AuditReport) -> pb.Signed:
    """`report` signed by the auditor `identity` under the audit-report domain."""
    return signing.sign(identity, signing.AUDIT_REPORT, report)
