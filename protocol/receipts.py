"""Signed batch receipts: the trainer's answer to one rollout batch, signed, so that the worker
holds proof of what the trainer admitted from it (the start of public credit, issue 27).

The trainer signs an `AdmissionReceipt` (domain "batch-receipt") for every batch it accepted,
i.e. whose groups it checked one by one and recorded: job id, batch id, the worker, the lease,
the prompt indices admitted, the group count, the job's policy version and the trainer's clock.
A batch refused as a whole (bad signature, replay, unknown lease, banned, ...) gets no
signature: it earned nothing, and anyone can send one, so signing refusals would only hand out
the trainer's signatures for free.

The worker checks a receipt before it keeps it (`verify_receipt`): signed, by the trainer it
leased from, about its own batch (job, batch id, peer, lease, group count), naming only prompts
the batch carried, once each, and saying what the unsigned answer says (the per-group verdicts
the worker logs). A receipt failing any check is refused with a named reason (`REASONS`); the
caller counts it and carries on.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

UNSIGNED = "unsigned"              # an accepted answer without a signed receipt
BAD_SIGNATURE = "bad_signature"    # the signature does not verify under the domain
MALFORMED = "malformed"            # the signed body does not parse
WRONG_TRAINER = "wrong_trainer"    # signed, but not by the trainer the lease came from
JOB_MISMATCH = "job_mismatch"
BATCH_MISMATCH = "batch_mismatch"  # the receipt is about another batch (a replayed receipt)
PEER_MISMATCH = "peer_mismatch"
LEASE_MISMATCH = "lease_mismatch"
NOT_IN_BATCH = "not_in_batch"      # an admitted prompt the batch did not carry, a repeat, or a wrong group count
ANSWER_MISMATCH = "answer_mismatch"  # the signed admitted prompts differ from the answer's verdicts
REASONS = frozenset({UNSIGNED, BAD_SIGNATURE, MALFORMED, WRONG_TRAINER, JOB_MISMATCH, BATCH_MISMATCH,
                     PEER_MISMATCH, LEASE_MISMATCH, NOT_IN_BATCH, ANSWER_MISMATCH})


class ReceiptError(ValueError):
    """A batch receipt that must not be kept; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def admission_receipt(batch_id: str, batch: pb.RolloutBatch, admitted: Iterable[int], *, policy_version: int,
                      at_ms: int) -> pb.AdmissionReceipt:
    """What the trainer signs for an accepted `batch` (id `batch_id`): the prompt indices of its
    admitted groups (batch order), at the job's `policy_version` and unix ms `at_ms`."""
    return pb.AdmissionReceipt(job_id=batch.job_id, batch_id=batch_id, peer_id=batch.peer_id, lease_id=batch.lease_id,
                               admitted=list(admitted), groups=len(batch.groups), policy_version=policy_version,
                               at_ms=at_ms)


def sign_receipt(identity: Identity, receipt: pb.AdmissionReceipt) -> pb.Signed:
    """`receipt` signed by the trainer `identity` under the batch-receipt domain."""
    return signing.sign(identity, signing.BATCH_RECEIPT, receipt)


def open_receipt(envelope: pb.Signed) -> tuple[pb.AdmissionReceipt, str]:
    """Verify a signed receipt's signature and parse it. Returns (receipt, signer peer id).

    Raises:
        ReceiptError: BAD_SIGNATURE or MALFORMED.
    """
    try:
        return signing.open_signed(envelope, signing.BATCH_RECEIPT, pb.AdmissionReceipt)
    except signing.SignatureError as exc:
        raise ReceiptError(BAD_SIGNATURE if exc.reason == "bad_signature" else MALFORMED, str(exc)) from exc


def verify_receipt(answer: pb.BatchReceipt, sent: pb.RolloutBatch, batch_id: str, trainer_id: str) -> pb.AdmissionReceipt:
    """Check the trainer's accepted `answer` to the batch `sent` (id `batch_id`) before keeping
    it: see the module docstring. Returns the signed receipt.

    Raises:
        ReceiptError: with the first failed check's reason (`REASONS`).
    """
    if not answer.HasField("signed") or not answer.signed.signature:
        raise ReceiptError(UNSIGNED, f"batch {batch_id[:12]}: the trainer's answer carries no signed receipt")
    receipt, signer = open_receipt(answer.signed)
    if signer != trainer_id:
        raise ReceiptError(WRONG_TRAINER, f"signed by {signer[:12]}, the lease came from {trainer_id[:12]}")
    for reason, got, want in ((JOB_MISMATCH, receipt.job_id, sent.job_id), (BATCH_MISMATCH, receipt.batch_id, batch_id),
                              (PEER_MISMATCH, receipt.peer_id, sent.peer_id), (LEASE_MISMATCH, receipt.lease_id, sent.lease_id)):
        if got != want:
            raise ReceiptError(reason, f"receipt names {got[:24]!r}, the batch {want[:24]!r}")
    carried = {g.prompt_index for g in sent.groups}
    admitted = list(receipt.admitted)
    if receipt.groups != len(sent.groups) or len(set(admitted)) != len(admitted) or not set(admitted) <= carried:
        raise ReceiptError(NOT_IN_BATCH, f"receipt admits {admitted[:8]} of {receipt.groups} groups; the batch "
                                         f"carried {len(sent.groups)} groups")
    said = [int(g.prompt_index) for g in answer.groups if g.admitted]
    if said != admitted:
        raise ReceiptError(ANSWER_MISMATCH, f"receipt admits {admitted[:8]}, the answer's verdicts {said[:8]}")
    return receipt
