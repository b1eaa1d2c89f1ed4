"""A validator's verdict report delivered twice (a retry after a lost ack, or a replay by anyone
who saw it) counts once: the ledger records each (validator, batch, prompt index) verdict once and
tells which verdicts were new, and the trainer acts only on those. So a replay neither bans the
peer a second time nor, after its first ban expired, bans it (and drops its fresh groups) again."""

from __future__ import annotations

from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import BAN_MS, LOGPROB
from tests.unit.test_trainer_job import _honest_batch, _lease, _submit, clock, runtime  # noqa: F401 - fixtures


def _report(job_id: str, peer_id: str, batch_id: str, prompt_index: int) -> pb.VerdictReport:
    failed = pb.Verdict(job_id=job_id, peer_id=peer_id, batch_id=batch_id, prompt_index=prompt_index,
                        passed=False, check=LOGPROB, detail="mean gap 1.2")
    return pb.VerdictReport(job_id=job_id, verdicts=[failed], created_ms=1)


def test_the_ledger_says_which_verdicts_are_new(tmp_path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    a = pb.Verdict(job_id="j", peer_id="p", batch_id="b1", prompt_index=0, passed=True, check="all")
    b = pb.Verdict(job_id="j", peer_id="p", batch_id="b1", prompt_index=1, passed=False, check=LOGPROB)
    assert ledger.add_verdicts("j", "v1", [a, a, b], 10) == [a, b]   # a repeat inside one report counts once
    assert ledger.add_verdicts("j", "v1", [b, a], 20) == []
    assert ledger.add_verdicts("j", "v2", [b], 30) == [b]            # another validator's own verdict is new
    assert ledger.verdict_counts("j") == (3, 2)
    ledger.close()


def test_a_report_delivered_twice_bans_once_and_a_replay_after_expiry_does_not_ban_again(runtime, clock) -> None:  # noqa: F811
    job, ledger, _ = runtime
    cheat = Identity.from_seed(b"c" * 32)
    lease = _lease(job, cheat)
    assert _submit(job, _honest_batch(job, cheat, lease)).groups[0].admitted
    report = _report(job.job_id, cheat.peer_id, "b", lease.prompt_indices[0])

    assert job.admission.apply_verdicts("validator", report) == [cheat.peer_id]
    first_ban = ledger.bans(job.job_id)
    assert [(p, at) for p, _, at, _ in first_ban] == [(cheat.peer_id, job.admission.now_ms())]
    clock.advance(60)
    assert job.admission.apply_verdicts("validator", report) == []          # the retry: no second ban
    assert ledger.bans(job.job_id) == first_ban and ledger.verdict_counts(job.job_id) == (1, 1)

    clock.advance(BAN_MS / 1000)                                            # the ban ends
    again = _lease(job, cheat)                                              # (a lease request expires it)
    assert cheat.peer_id not in job.admission.banned and not ledger.bans(job.job_id)
    assert _submit(job, _honest_batch(job, cheat, again)).groups[0].admitted
    assert job.admission.apply_verdicts("validator", report) == []          # the replay
    assert cheat.peer_id not in job.admission.banned and not ledger.bans(job.job_id)
    assert ledger.count_pending(job.job_id) == 1                            # its fresh group is kept
    assert job.admission.request_lease(cheat.peer_id, pb.LeaseRequest(job_id=job.job_id)).reason != "banned"
    assert ledger.verdict_counts(job.job_id) == (1, 1)


def test_a_ban_that_failed_is_made_by_the_validators_retry(runtime, monkeypatch) -> None:  # noqa: F811
    """Fault injection: the first ban raises (a full disk, a crash between the two writes). The
    verdicts were not recorded, so the validator's retry of the same report bans."""
    job, ledger, _ = runtime
    cheat = Identity.from_seed(b"d" * 32)
    lease = _lease(job, cheat)
    assert _submit(job, _honest_batch(job, cheat, lease)).groups[0].admitted
    report = _report(job.job_id, cheat.peer_id, "b-fail", lease.prompt_indices[0])
    real_ban = job.admission.ban

    def failing_ban(*args, **kwargs):
        monkeypatch.setattr(job.admission, "ban", real_ban)
        raise OSError("disk full")

    monkeypatch.setattr(job.admission, "ban", failing_ban)
    try:
        job.admission.apply_verdicts("validator", report)
    except OSError:
        pass
    assert cheat.peer_id not in job.admission.banned and ledger.verdict_counts(job.job_id) == (0, 0)
    assert job.admission.apply_verdicts("validator", report) == [cheat.peer_id]   # the retry bans
    assert ledger.verdict_counts(job.job_id) == (1, 1)
    assert ledger.unseen_verdicts("validator", report.verdicts) == []
