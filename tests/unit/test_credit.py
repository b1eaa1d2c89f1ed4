"""Contribution statements (protocol/credit.py): built sorted and chained, verified, and every
refusal reason raised by the statement that earns it."""

from __future__ import annotations

import hashlib

import pytest

from swarmrl.protocol import credit, signing
from swarmrl.protocol.credit import ConsumedGroup, CreditError
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

TRAINER = Identity.from_seed(b"T" * 32)
JOB = "job-credit"


def bid(n: int) -> str:
    return hashlib.sha256(bytes([n])).hexdigest()


def update(v: int) -> pb.AdapterUpdate:
    return pb.AdapterUpdate(job_id=JOB, to_version=v, to_hash=bytes([v]) * 32, payload_sha256=bytes([v + 100]) * 32)


def chain(n: int, *, identity: Identity = TRAINER) -> list[pb.Signed]:
    """n statements, versions 1..n, two workers' batches each, a drop in the second."""
    out: list[pb.Signed] = []
    for v in range(1, n + 1):
        trained = [ConsumedGroup(bid(10 * v + 1), "peer-b", 100 * v + 2, 7), ConsumedGroup(bid(10 * v), "peer-a", 100 * v, 5),
                   ConsumedGroup(bid(10 * v), "peer-a", 100 * v + 1, 3)]
        dropped = [ConsumedGroup(bid(10 * v + 2), "peer-c", 100 * v + 3, reason="stale_at_step")] if v == 2 else []
        st = credit.build_statement(JOB, v, update(v), out[-1] if out else None, trained, dropped, 1000 + v)
        out.append(credit.sign_statement(identity, st))
    return out


def resign(env: pb.Signed, edit, identity: Identity = TRAINER) -> pb.Signed:
    st = pb.ContributionStatement.FromString(env.body)
    edit(st)
    return signing.sign(identity, signing.CONTRIBUTION, st)


def reason_of(call) -> str:
    with pytest.raises(CreditError) as info:
        call()
    assert info.value.reason in credit.REASONS
    return info.value.reason


def test_a_statement_is_sorted_derived_and_chained() -> None:
    envs = chain(3)
    sts = credit.verify_chain(envs, job_id=JOB, trainer_id=TRAINER.peer_id)
    first = sts[0]
    assert [b.batch_id for b in first.batches] == sorted(b.batch_id for b in first.batches)
    assert list(first.batches[0].prompt_indices) == [100, 101] and first.batches[0].tokens == 8
    assert [(p.peer_id, p.groups, p.tokens, p.batches) for p in first.peers] == [("peer-a", 2, 8, 1), ("peer-b", 1, 7, 1)]
    assert (first.groups, first.tokens, first.first_version, first.prev_sha256) == (3, 15, 1, b"")
    assert sts[1].prev_sha256 == credit.statement_sha256(envs[0]) == hashlib.sha256(envs[0].body).digest()
    assert [(d.reason, list(d.prompt_indices)) for d in sts[1].dropped] == [("stale_at_step", [203])]
    credit.check_adapter(sts[2], update(3))
    # a later run verifies on its own from an earlier, already checked statement
    assert [s.version for s in credit.verify_chain(envs[2:], job_id=JOB, trainer_id=TRAINER.peer_id, prev=envs[1])] == [3]


def test_model_tokens_count_only_the_models_tokens() -> None:
    g = pb.Group(completions=[pb.Completion(token_ids=[1, 2, 3]), pb.Completion(token_ids=[1, 2, 3, 4], token_mask=[1, 0, 0, 1])])
    assert credit.model_tokens(g) == 5


def test_a_gap_in_the_chain_is_refused_when_building() -> None:
    envs = chain(1)
    with pytest.raises(ValueError, match="after one of version 1"):
        credit.build_statement(JOB, 3, update(3), envs[0], [], [], 0)
    with pytest.raises(ValueError, match="not a sha256"):
        credit.build_statement(JOB, 1, update(1), None, [ConsumedGroup("abcd", "p", 1, 1)], [], 0)


def test_each_refusal_reason() -> None:
    envs = chain(3)
    one = envs[0]

    def verify(env: pb.Signed, **kw) -> object:
        return lambda: credit.verify_statement(env, job_id=kw.get("job", JOB), trainer_id=kw.get("trainer", TRAINER.peer_id))

    forged = pb.Signed(body=one.body, public_key=one.public_key, signature=bytes(64))
    assert reason_of(verify(forged)) == credit.BAD_SIGNATURE
    assert reason_of(verify(signing.sign(TRAINER, signing.CONTRIBUTION, pb.Signed(body=b"\xff\xff")))) in {
        credit.MALFORMED, credit.BAD_SIGNATURE}
    junk = pb.Signed(body=b"\x0a\xff", public_key=TRAINER.public_key)
    junk.signature = TRAINER.sign_raw(b"swarmrl.v1/contribution\x00" + junk.body)
    assert reason_of(verify(junk)) == credit.MALFORMED
    sybil = Identity.from_seed(b"S" * 32)
    assert reason_of(verify(chain(1, identity=sybil)[0])) == credit.WRONG_TRAINER
    assert reason_of(verify(one, job="another-job")) == credit.WRONG_JOB
    assert reason_of(verify(resign(one, lambda s: s.batches.reverse()))) == credit.UNSORTED
    assert reason_of(verify(resign(one, lambda s: s.batches[0].prompt_indices.reverse()))) == credit.UNSORTED
    assert reason_of(verify(resign(one, lambda s: s.peers.reverse()))) == credit.UNSORTED
    assert reason_of(verify(resign(one, lambda s: setattr(s.batches[0], "batch_id", b"short")))) == credit.BAD_BATCH_ID

    def inflate(s: pb.ContributionStatement) -> None:
        s.peers[0].groups += 5   # a peer's credit that its batches don't carry
    assert reason_of(verify(resign(one, inflate))) == credit.COUNTS_MISMATCH
    assert reason_of(verify(resign(one, lambda s: setattr(s, "tokens", s.tokens + 1)))) == credit.COUNTS_MISMATCH

    def run(envelopes: list[pb.Signed]) -> object:
        return lambda: credit.verify_chain(envelopes, job_id=JOB, trainer_id=TRAINER.peer_id)

    assert reason_of(run([envs[0], envs[2]])) == credit.BROKEN_CHAIN                       # a version skipped
    assert reason_of(run(envs[1:])) == credit.BROKEN_CHAIN                                  # no predecessor given
    assert reason_of(run([envs[0], resign(envs[1], lambda s: setattr(s, "prev_sha256", bytes(32)))])) == credit.BROKEN_CHAIN
    assert reason_of(run([envs[0], resign(envs[1], lambda s: setattr(s, "first_version", 2))])) == credit.BROKEN_CHAIN
    tampered = resign(envs[0], lambda s: setattr(s, "created_ms", 1))                       # rewritten history
    assert reason_of(run([tampered, envs[1]])) == credit.BROKEN_CHAIN

    def recredit(s: pb.ContributionStatement) -> None:
        s.dropped[0].prompt_indices[:] = [100]   # listed dropped now, credited in version 1
    assert reason_of(run([envs[0], resign(envs[1], recredit)])) == credit.DUPLICATE_CREDIT
    st = pb.ContributionStatement.FromString(envs[2].body)
    assert reason_of(lambda: credit.check_adapter(st, update(2))) == credit.ADAPTER_MISMATCH
    wrong = update(3)
    wrong.to_hash = bytes(32)
    assert reason_of(lambda: credit.check_adapter(st, wrong)) == credit.ADAPTER_MISMATCH
    wrong = update(3)
    wrong.payload_sha256 = bytes(32)
    assert reason_of(lambda: credit.check_adapter(st, wrong)) == credit.ADAPTER_MISMATCH
    # once the delta is pruned the trainer serves the version's snapshot: its payload is not the
    # delta's, so only the adapter hash counts (an honest trainer's floor version was flagged)
    snap = update(3)
    snap.snapshot, snap.payload_sha256 = True, bytes(32)
    credit.check_adapter(st, snap)
    snap.to_hash = bytes(32)
    assert reason_of(lambda: credit.check_adapter(st, snap)) == credit.ADAPTER_MISMATCH
