"""Signed batch receipts (protocol.receipts) and the worker's receipt store (node.worker.receipts):
a receipt the trainer signed verifies; every forgery a worker can be handed is refused with its
named reason; the store keeps verified receipts durably, once per batch, and sums credit per job."""

from __future__ import annotations

import pytest

from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
from swarmrl.protocol import receipts as rc
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

TRAINER, WORKER, OTHER = (Identity.from_seed(s * 32) for s in (b"t", b"w", b"o"))


def _batch(indices: list[int], job_id: str = "job-a", nonce: bytes = b"n") -> tuple[pb.RolloutBatch, str]:
    batch = pb.RolloutBatch(job_id=job_id, lease_id="L1", peer_id=WORKER.peer_id, nonce=nonce,
                            groups=[pb.Group(prompt_index=i) for i in indices])
    return batch, signing.envelope_id(signing.sign(WORKER, signing.ROLLOUT_BATCH, batch))


def _answer(batch: pb.RolloutBatch, batch_id: str, admitted: list[int], *, signer: Identity = TRAINER,
            at_ms: int = 1_000, version: int = 3) -> pb.BatchReceipt:
    """The trainer's accepted answer: per-group verdicts and the signed receipt saying the same."""
    receipt = rc.admission_receipt(batch_id, batch, admitted, policy_version=version, at_ms=at_ms)
    groups = [pb.GroupVerdict(prompt_index=g.prompt_index, admitted=g.prompt_index in admitted,
                              reason="" if g.prompt_index in admitted else "stale") for g in batch.groups]
    return pb.BatchReceipt(batch_id=batch_id, accepted=True, groups=groups, signed=rc.sign_receipt(signer, receipt))


def _refused(answer: pb.BatchReceipt, batch: pb.RolloutBatch, batch_id: str) -> str:
    with pytest.raises(rc.ReceiptError) as caught:
        rc.verify_receipt(answer, batch, batch_id, TRAINER.peer_id)
    assert caught.value.reason in rc.REASONS
    return caught.value.reason


def test_a_trainer_signed_receipt_verifies_with_what_it_admitted() -> None:
    batch, batch_id = _batch([4, 5, 6])
    receipt = rc.verify_receipt(_answer(batch, batch_id, [4, 6]), batch, batch_id, TRAINER.peer_id)
    assert (receipt.job_id, receipt.batch_id, receipt.peer_id, receipt.lease_id) == ("job-a", batch_id, WORKER.peer_id, "L1")
    assert list(receipt.admitted) == [4, 6] and receipt.groups == 3
    assert (receipt.policy_version, receipt.at_ms) == (3, 1_000)


def test_forged_or_foreign_receipts_are_refused_with_a_named_reason() -> None:
    batch, batch_id = _batch([4, 5])
    good = _answer(batch, batch_id, [4])
    unsigned = pb.BatchReceipt(batch_id=batch_id, accepted=True, groups=good.groups)
    assert _refused(unsigned, batch, batch_id) == rc.UNSIGNED
    assert _refused(_answer(batch, batch_id, [4], signer=OTHER), batch, batch_id) == rc.WRONG_TRAINER

    inflated = pb.AdmissionReceipt.FromString(good.signed.body)   # the worker (or a proxy) edits what was signed
    inflated.admitted.append(5)
    tampered = pb.BatchReceipt()
    tampered.CopyFrom(good)
    tampered.signed.body = signing.canonical_bytes(inflated)
    assert _refused(tampered, batch, batch_id) == rc.BAD_SIGNATURE

    other_domain = pb.BatchReceipt()   # a real trainer signature, but over a message of another kind
    other_domain.CopyFrom(good)
    other_domain.signed.CopyFrom(signing.sign(TRAINER, signing.VERDICTS, pb.AdmissionReceipt.FromString(good.signed.body)))
    assert _refused(other_domain, batch, batch_id) == rc.BAD_SIGNATURE

    garbage = pb.BatchReceipt()
    garbage.CopyFrom(good)
    body = b"\xff\xff"   # properly signed bytes that are no AdmissionReceipt
    garbage.signed.CopyFrom(pb.Signed(body=body, public_key=TRAINER.public_key,
                                      signature=TRAINER.sign_raw(b"swarmrl.v1/batch-receipt\x00" + body)))
    assert _refused(garbage, batch, batch_id) == rc.MALFORMED


def test_a_receipt_about_another_batch_or_claiming_more_is_refused() -> None:
    batch, batch_id = _batch([4, 5])
    earlier, earlier_id = _batch([4, 5], nonce=b"earlier")
    assert _refused(_answer(earlier, earlier_id, [4]), batch, batch_id) == rc.BATCH_MISMATCH   # a replayed receipt
    other_job, _ = _batch([4, 5], job_id="job-b")
    assert _refused(_answer(other_job, batch_id, [4]), batch, batch_id) == rc.JOB_MISMATCH
    assert _refused(_answer(batch, batch_id, [4, 9]), batch, batch_id) == rc.NOT_IN_BATCH      # never sent
    said_more = _answer(batch, batch_id, [4])
    said_more.groups[1].admitted = True   # the unsigned answer says 5 was admitted too; the signature does not
    assert _refused(said_more, batch, batch_id) == rc.ANSWER_MISMATCH
    lease = pb.RolloutBatch()
    lease.CopyFrom(batch)
    lease.lease_id = "L2"
    assert _refused(_answer(lease, batch_id, [4]), batch, batch_id) == rc.LEASE_MISMATCH


def test_the_store_keeps_receipts_once_durably_and_sums_credit_per_job(tmp_path) -> None:
    path = receipts_path(tmp_path, WORKER.peer_id)
    store = ReceiptStore(path)
    a1, a1_id = _batch([1, 2, 3], nonce=b"1")
    a2, a2_id = _batch([7], nonce=b"2")
    b1, b1_id = _batch([1, 2], job_id="job-b")
    first = _answer(a1, a1_id, [1, 3], at_ms=5_000)
    assert store.add(first.signed) and not store.add(first.signed)   # the same batch's receipt once
    assert store.add(_answer(a2, a2_id, [7], at_ms=9_000).signed)
    assert store.add(_answer(b1, b1_id, [], at_ms=6_000).signed)     # accepted, nothing admitted: still a receipt
    forged = _answer(b1, b1_id, [1, 2], at_ms=7_000).signed
    forged.signature = bytes(64)
    with pytest.raises(rc.ReceiptError):
        store.add(forged)
    store.close()

    again = ReceiptStore(path)   # reopened: nothing lost
    credit = {c.job_id: c for c in again.credit()}
    assert [c.job_id for c in again.credit()] == ["job-a", "job-b"]   # latest receipt first
    a = credit["job-a"]
    assert (a.admitted, a.groups, a.batches, a.trainers, a.first_ms, a.last_ms) == (3, 4, 2, 1, 5_000, 9_000)
    b = credit["job-b"]
    assert (b.admitted, b.groups, b.batches, b.first_ms, b.last_ms) == (0, 2, 1, 6_000, 6_000)
    kept = again.receipt(a1_id)
    assert kept == first.signed and again.receipt("nope") is None
    assert list(rc.open_receipt(kept)[0].admitted) == [1, 3]
    again.close()
