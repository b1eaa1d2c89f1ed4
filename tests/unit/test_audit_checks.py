"""protocol/audit.py's pure checks: each finding reason from the input that earns it, and none
from honest books."""

from __future__ import annotations

from typing import Any

from swarmrl.protocol import audit, credit, receipts, signing
from swarmrl.protocol.credit import ConsumedGroup
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

TRAINER, WORKER = Identity.from_seed(b"T" * 32), Identity.from_seed(b"W" * 32)
JOB = "job-audit"


def _batch(indices: list[int], job: str = JOB, who: Identity = WORKER) -> tuple[str, pb.Signed]:
    groups = [pb.Group(prompt_index=i, completions=[pb.Completion(token_ids=[1, 2, 3])]) for i in indices]
    env = signing.sign(who, signing.ROLLOUT_BATCH, pb.RolloutBatch(job_id=job, peer_id=who.peer_id, groups=groups))
    return signing.envelope_id(env), env


def _statement(batch_id: str, indices: list[int], tokens: int, version: int = 1,
               prev: pb.Signed | None = None) -> pb.Signed:
    trained = [ConsumedGroup(batch_id, WORKER.peer_id, i, tokens // len(indices)) for i in indices]
    st = credit.build_statement(JOB, version, pb.AdapterUpdate(to_version=version), prev, trained, [], 1)
    return credit.sign_statement(TRAINER, st)


def _reasons(findings: list[pb.AuditFinding]) -> list[str]:
    return [f.reason for f in findings]


def test_an_honest_batch_passes_and_each_bad_one_is_named() -> None:
    bid, env = _batch([1, 2])
    st = pb.ContributionStatement.FromString(_statement(bid, [1, 2], 6).body)
    credited = st.batches[0]
    served = pb.AdmittedBatch(batch=env, admitted_prompt_indices=[1, 2])
    assert audit.check_batch(JOB, 1, credited, served) == []
    assert _reasons(audit.check_batch(JOB, 1, credited, None)) == [audit.UNKNOWN_BATCH]
    _, other = _batch([7])
    assert _reasons(audit.check_batch(JOB, 1, credited, pb.AdmittedBatch(batch=other))) == [audit.UNKNOWN_BATCH]
    forged = pb.Signed(body=env.body, public_key=env.public_key, signature=bytes(64))
    assert _reasons(audit.check_batch(JOB, 1, credited, pb.AdmittedBatch(batch=forged))) == [audit.FORGED_BATCH]
    sybil = pb.CreditedBatch()
    sybil.CopyFrom(credited)
    sybil.peer_id = "a-sybil"
    assert _reasons(audit.check_batch(JOB, 1, sybil, served)) == [audit.WRONG_WORKER]
    bid2, env2 = _batch([1, 2], job="another")
    st2 = pb.ContributionStatement.FromString(_statement(bid2, [1, 2], 6).body)
    assert _reasons(audit.check_batch(JOB, 1, st2.batches[0], pb.AdmittedBatch(
        batch=env2, admitted_prompt_indices=[1, 2]))) == [credit.WRONG_JOB]
    partly = pb.AdmittedBatch(batch=env, admitted_prompt_indices=[1])
    assert _reasons(audit.check_batch(JOB, 1, credited, partly)) == [audit.NOT_ADMITTED]
    inflated = pb.CreditedBatch()
    inflated.CopyFrom(credited)
    inflated.tokens = 60
    assert _reasons(audit.check_batch(JOB, 1, inflated, served)) == [credit.COUNTS_MISMATCH]


def test_chain_findings_keep_the_good_prefix() -> None:
    bid, _ = _batch([1])
    one = _statement(bid, [1], 3)
    two = _statement(_batch([2])[0], [2], 3, version=2, prev=one)
    good, found = audit.check_chain([one, two], job_id=JOB, trainer_id=TRAINER.peer_id)
    assert [s.version for s in good] == [1, 2] and found == []
    bad_two = _statement(_batch([2])[0], [2], 3, version=2, prev=None)   # names no predecessor
    good, found = audit.check_chain([one, bad_two], job_id=JOB, trainer_id=TRAINER.peer_id)
    assert [s.version for s in good] == [1] and _reasons(found) == [credit.BROKEN_CHAIN] and found[0].version == 2
    heads = {1: credit.statement_sha256(one)}
    assert audit.check_record(good, heads, 1, heads[1]) == [] and audit.check_record(good, heads, 0, b"") == []
    assert _reasons(audit.check_record(good, heads, 1, bytes(32))) == [audit.RECORD_MISMATCH]


def _receipt(batch_id: str, admitted: list[int], version: int, signer: Identity = TRAINER) -> pb.Signed:
    r = pb.AdmissionReceipt(job_id=JOB, batch_id=batch_id, peer_id=WORKER.peer_id, admitted=admitted,
                            groups=len(admitted), policy_version=version)
    return receipts.sign_receipt(signer, r)


def test_receipts_are_covered_pending_or_omitted() -> None:
    bid, _ = _batch([1, 2])
    one = pb.ContributionStatement.FromString(_statement(bid, [1, 2], 6).body)
    lost = _batch([9])[0]
    kw: dict[str, Any] = {"job_id": JOB, "trainer_id": TRAINER.peer_id, "max_async_level": 1}
    found, checked, pending = audit.check_receipts([_receipt(bid, [1, 2], 0)], [one], final_version=None, **kw)
    assert (found, checked, pending) == ([], 1, 0)
    found, checked, pending = audit.check_receipts([_receipt(lost, [9], 0)], [one], final_version=None, **kw)
    assert (found, checked, pending) == ([], 1, 1)                     # not due at version 1 (0 + 1 + 2 > 1)
    found, _, _ = audit.check_receipts([_receipt(lost, [9], 0)], [one], final_version=1, **kw)
    assert _reasons(found) == [audit.OMITTED_GROUP] and found[0].batch_id == lost   # the job ended at version 1
    forged = _receipt(lost, [9], 0)
    forged.signature = bytes(64)
    found, checked, _ = audit.check_receipts([forged], [one], final_version=1, **kw)
    assert _reasons(found) == [audit.FORGED_RECEIPT] and checked == 0
    other = _receipt(lost, [9], 0, signer=Identity.from_seed(b"C" * 32))   # a cotrainer's: not this chain's
    assert audit.check_receipts([other], [one], final_version=1, **kw) == ([], 0, 0)
    assert audit.due(3, 6, 1, None) and not audit.due(4, 6, 1, None) and audit.due(4, 5, 1, 5)


def test_the_report_is_signed_by_the_auditor() -> None:
    auditor = Identity.from_seed(b"A" * 32)
    report = audit.audit_report(JOB, TRAINER.peer_id, [], {}, [audit.finding(audit.OMITTED_GROUP, version=3)],
                                batches_checked=0, batches_unavailable=0, receipts_checked=1, receipts_pending=0,
                                auditor_id=auditor.peer_id, created_ms=5)
    body, signer = signing.open_signed(audit.sign_report(auditor, report), signing.AUDIT_REPORT, pb.AuditReport)
    assert signer == auditor.peer_id and body == report and audit.REASONS >= credit.REASONS
