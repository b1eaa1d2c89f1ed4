"""`swarmrl audit` against a real trainer on loopback (hosting.Trainer behind its gRPC server,
the tiny job, two workers' signed batches through the trainer's admission, real steps): clean
books exit 0; a tampered statement store, and a consistent chain that omits a worker's batch
(re-signed by the trainer's key), are flagged with their reasons (exit 1) and the signed report
verifies; a job it can't reach is one line and exit 2."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from swarmrl.node.cli.main import main
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.submitter.client import sign_job, stub
from swarmrl.node.swarm.audit_records import audits_key, publish_report
from swarmrl.node.swarm.dht import start_dht
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.service import serve
from swarmrl.node.worker.receipts import ReceiptStore
from swarmrl.protocol import credit, receipts, signing
from swarmrl.protocol.adapter import AdapterError
from swarmrl.protocol.audit import sign_report
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import assemble, headers
from tests.unit.test_red_team import _group

pytestmark = pytest.mark.integration
WORKERS = [Identity.from_seed(bytes([65 + i]) * 32) for i in range(2)]


def run_tiny_job(trainer: Trainer, receipts_dir: Path, steps: int = 3) -> tuple[JobRuntime, list[ReceiptStore]]:
    """Submit the tiny job (`steps` steps, 2 groups each) to `trainer` and drive it to the end through
    its admission with two workers' signed batches; each worker keeps the trainer's receipts in
    `receipts_dir`. Returns the job and the receipt stores (the caller closes them)."""
    spec = builtin_job("tiny", trainer.cfg.cache_dir, steps=steps, batch_groups=2, group_size=2, prompts_per_lease=1)
    ack = trainer.submit_job(sign_job(Identity.generate(), spec))
    assert ack.accepted, ack.reason
    job = trainer.jobs[ack.job_id]
    receipts_dir.mkdir(exist_ok=True)
    stores = {w.peer_id: ReceiptStore(receipts_dir / f"{w.peer_id}.sqlite") for w in WORKERS}
    while not job.done:
        for w in WORKERS:
            reply = job.admission.request_lease(w.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))
            i = reply.lease.prompt_indices[0]
            group = _group(i, job.prompt_ids(i), version=job.version, n=2)
            group.completions[0].reward = 1.0
            body = pb.RolloutBatch(job_id=job.job_id, lease_id=reply.lease.lease_id, peer_id=w.peer_id, groups=[group])
            env = signing.sign(w, signing.ROLLOUT_BATCH, body)
            answer = trainer.admit(env)
            kept = receipts.verify_receipt(answer, body, signing.envelope_id(env), trainer.identity.peer_id)
            assert kept.admitted and stores[w.peer_id].add(answer.signed)
        if job.ready():
            job.train_step()
    return job, list(stores.values())


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_cache):
    tmp = tmp_path_factory.mktemp("audit")
    trainer = Trainer(TrainerConfig(state_dir=tmp / "trainer", cache_dir=model_cache), Identity.from_seed(b"T" * 32))
    job, stores = run_tiny_job(trainer, tmp / "receipts")
    server, port = serve(trainer, "127.0.0.1", 0, 16)
    yield trainer, job, f"127.0.0.1:{port}", tmp
    server.stop(0)
    for s in stores:
        s.close()
    trainer.ledger.close()


def _audit(capsys, endpoint: str, job_id: str, *extra: str) -> tuple[int, dict]:
    code = main(["audit", job_id, "--trainer", endpoint, "--sample", "0", "--json", *extra])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_clean_books_then_tampering_and_omission_are_flagged(served, capsys) -> None:
    trainer, job, endpoint, tmp = served
    code, report = _audit(capsys, endpoint, job.job_id, "--receipts", str(tmp / "receipts"),
                          "--report", str(tmp / "report.bin"), "--key", str(tmp / "auditor.key"))
    assert code == 0, report
    assert report.get("findings") is None and int(report["statements"]) == 3 == job.version
    assert int(report["batchesChecked"]) == 6 and int(report["receiptsChecked"]) == 6
    signed = pb.Signed.FromString((tmp / "report.bin").read_bytes())
    body, auditor = signing.open_signed(signed, signing.AUDIT_REPORT, pb.AuditReport)
    assert auditor == Identity.load(tmp / "auditor.key").peer_id and body.statements == 3

    db = sqlite3.connect(tmp / "trainer" / "ledger.sqlite")
    rows = db.execute("SELECT version, envelope FROM statements WHERE job_id = ? ORDER BY version",
                      (job.job_id,)).fetchall()
    original = {v: e for v, e in rows}
    try:
        # a tampered store: version 2's body edited (its signature no longer verifies)
        env = pb.Signed.FromString(original[2])
        st = pb.ContributionStatement.FromString(env.body)
        st.created_ms += 1
        db.execute("UPDATE statements SET envelope = ? WHERE job_id = ? AND version = 2",
                   (pb.Signed(body=st.SerializeToString(), public_key=env.public_key,
                              signature=env.signature).SerializeToString(), job.job_id))
        db.commit()
        code, report = _audit(capsys, endpoint, job.job_id)
        assert code == 1 and [f["reason"] for f in report["findings"]] == [credit.BAD_SIGNATURE]

        # the trainer re-signs a consistent chain from version 2 on that drops one worker's batch
        prev = pb.Signed.FromString(original[1])
        victim = None
        for v in (2, 3):
            st = pb.ContributionStatement.FromString(pb.Signed.FromString(original[v]).body)
            if v == 2:
                victim = pb.CreditedBatch()
                victim.CopyFrom(st.batches[0])
                del st.batches[0]
                del st.peers[:]
                st.peers.extend(credit.peer_totals(st.batches))
                st.groups, st.tokens = sum(len(b.prompt_indices) for b in st.batches), sum(b.tokens for b in st.batches)
            st.prev_sha256 = credit.statement_sha256(prev)
            prev = credit.sign_statement(trainer.identity, st)
            db.execute("UPDATE statements SET envelope = ?, sha256 = ? WHERE job_id = ? AND version = ?",
                       (prev.SerializeToString(), credit.statement_sha256(prev), job.job_id, v))
        db.commit()
        code, report = _audit(capsys, endpoint, job.job_id)
        assert code == 0   # without receipts the books look whole: the omission is the worker's to prove
        code, report = _audit(capsys, endpoint, job.job_id, "--receipts", str(tmp / "receipts"))
        assert code == 1
        assert [(f["reason"], f["batchId"], f["peerId"]) for f in report["findings"]] == [
            ("omitted_group", bytes(victim.batch_id).hex(), victim.peer_id)]
    finally:
        for v, e in original.items():
            db.execute("UPDATE statements SET envelope = ?, sha256 = ? WHERE job_id = ? AND version = ?",
                       (e, credit.statement_sha256(pb.Signed.FromString(e)), job.job_id, v))
        db.commit()
        db.close()


def test_a_windowed_audit_draws_among_the_recent_statements(served, capsys) -> None:
    """`--window-s` draws the batches and updates only among the statements of the last seconds
    (the chain is still checked whole); `--adapters all` checks every kept update in it."""
    _, job, endpoint, _ = served
    code, report = _audit(capsys, endpoint, job.job_id, "--window-s", "3600", "--adapters", "all")
    assert code == 0, report
    assert int(report["statements"]) == 3 and int(report["batchesChecked"]) == 6
    code, report = _audit(capsys, endpoint, job.job_id, "--window-s", "0.001")
    assert code == 0 and int(report["statements"]) == 3 and int(report.get("batchesChecked", 0)) == 0


def test_an_update_header_comes_without_its_payload(served) -> None:
    """The audit's adapter check asks `header_only`: the signed headers alone (no payload byte),
    the same ones a full fetch verifies; a header another key signed is refused."""
    trainer, job, endpoint, _ = served
    req = pb.AdapterRequest(job_id=job.job_id, have_version=0, want_version=job.version, requester="auditor")
    full = list(assemble(stub(endpoint).FetchAdapter(req, timeout=30), trainer.identity.peer_id))
    req.header_only = True
    got = list(stub(endpoint).FetchAdapter(req, timeout=30))
    assert len(got) == len(full) == job.version and all(c.last and not c.data for c in got)
    assert max(c.ByteSize() for c in got) < 1024, [c.ByteSize() for c in got]   # a signed header, no delta
    assert [h.to_hash for h in headers(got, trainer.identity.peer_id)] == [u.header.to_hash for u in full]
    with pytest.raises(AdapterError, match="not by the job's trainer"):
        list(headers(got, Identity.generate().peer_id))


def test_reports_are_published_in_the_dht_and_listed(served, capsys, tmp_path) -> None:
    """`--publish` stores the signed report under the job and the auditor's key; `--published`
    lists every auditor's verified report (a forged one dropped), exit 1 when any has findings."""
    _, job, endpoint, _ = served
    dht = start_dht()   # the swarm: one DHT node on loopback
    try:
        peers = [str(a) for a in dht.get_visible_maddrs()]
        key = tmp_path / "auditor.key"
        assert main(["audit", job.job_id, "--trainer", endpoint, "--key", str(key), "--publish",
                     "--initial-peers", *peers]) == 0
        honest = Identity.load(key)
        mallory = Identity.generate()   # a report in the honest auditor's name, signed by another key
        forged = pb.AuditReport(job_id=job.job_id, auditor_id=honest.peer_id, created_ms=1,
                                findings=[pb.AuditFinding(reason=credit.BAD_SIGNATURE)])
        dht.store(audits_key(job.job_id), sign_report(mallory, forged).SerializeToString(),
                  expiration_time=get_dht_time() + 60, subkey=mallory.peer_id)
        capsys.readouterr()
        assert main(["audit", job.job_id, "--published", "--initial-peers", *peers, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [r["auditorId"] for r in listed] == [honest.peer_id] and int(listed[0]["statements"]) == 3

        other = Identity.generate()   # another auditor's report with a finding: listed, exit 1
        found = pb.AuditReport(job_id=job.job_id, auditor_id=other.peer_id, created_ms=2, statements=3,
                               findings=[pb.AuditFinding(reason=credit.BAD_SIGNATURE, version=2)])
        assert publish_report(dht, sign_report(other, found))
        assert main(["audit", job.job_id, "--published", "--initial-peers", *peers]) == 1   # the table
        capsys.readouterr()
        assert main(["audit", job.job_id, "--published", "--initial-peers", *peers, "--json"]) == 1
        listed = json.loads(capsys.readouterr().out)
        assert [(r["auditorId"], [f["reason"] for f in r.get("findings", [])]) for r in listed] == [
            (honest.peer_id, []), (other.peer_id, [credit.BAD_SIGNATURE])]   # newest first (by created_ms)
        assert main(["audit", "no-such-job", "--published", "--initial-peers", *peers]) == 2
        assert main(["audit", job.job_id, "--publish", "--trainer", endpoint]) == 2   # no --initial-peers
        assert main(["audit", job.job_id]) == 2   # no --trainer
        assert "--trainer HOST:PORT or --initial-peers MADDR is required" in capsys.readouterr().err
    finally:
        dht.shutdown()


def test_credit_adds_up_against_the_step_rows(served) -> None:
    trainer, job, _, _ = served
    chain = credit.verify_chain(trainer.ledger.statements(job.job_id, 0, 100), job_id=job.job_id,
                                trainer_id=trainer.identity.peer_id)
    assert sum(s.groups for s in chain) == sum(int(r["groups_trained"]) for r in trainer.ledger.steps(job.job_id))


def test_a_job_it_cannot_reach_is_one_line_and_exit_2(served, capsys) -> None:
    _, job, endpoint, _ = served
    assert main(["audit", "no-such-job", "--trainer", endpoint]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not host job" in err[0]
    assert main(["audit", job.job_id, "--trainer", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach" in err[0]


def test_a_validator_in_audit_mode_audits_every_job_and_publishes_its_reports(served) -> None:
    """validator/audits.py: when due, one windowed audit per (job, trainer) of the records read;
    the signed report is published in the DHT under the validator's key and verifies there; a
    record naming another trainer is flagged; an unreachable trainer is counted, never raised."""
    from swarmrl.node.swarm.audit_records import published_reports
    from swarmrl.node.swarm.dht import VerifiedRecord
    from swarmrl.validator.audits import AuditMode

    trainer, job, endpoint, _ = served
    me = trainer.identity
    honest = VerifiedRecord(pb.JobRecord(job_id=job.job_id, trainer_id=me.peer_id, endpoint=endpoint),
                            me.peer_id, me.public_key)
    impostor = Identity.generate()   # a record signed by another trainer key that points at these books
    wrong = VerifiedRecord(pb.JobRecord(job_id=job.job_id, trainer_id=impostor.peer_id, endpoint=endpoint),
                           impostor.peer_id, impostor.public_key)
    gone = VerifiedRecord(pb.JobRecord(job_id="gone", trainer_id=me.peer_id, endpoint="127.0.0.1:1"),
                          me.peer_id, me.public_key)
    validator = Identity.generate()
    now = [1000.0]
    dht = start_dht()
    try:
        mode = AuditMode(validator, 600, sample=0, publish=lambda s: publish_report(dht, s), clock=lambda: now[0])
        assert mode.due() and mode.plan.window_s == 600 and mode.plan.adapters is None
        results = mode.run([honest, honest, wrong, gone])   # the honest record twice: audited once
        assert [(r.trainer_id, r.findings, r.published, r.signed is not None) for r in results] == [
            (me.peer_id, 0, True, True), (impostor.peer_id, results[1].findings, True, True),
            (me.peer_id, 0, False, False)]
        assert results[1].findings > 0 and set(mode.findings) == {credit.WRONG_TRAINER}
        assert dict(mode.counts) == {"clean": 1, "findings": 1, "unreachable": 1} and mode.published == 2
        body, signer = signing.open_signed(results[0].signed, signing.AUDIT_REPORT, pb.AuditReport)
        assert signer == validator.peer_id and body.statements == 3 and body.batches_checked == 6
        listed = published_reports(dht, job.job_id)   # one subkey per auditor: the newest report stands
        assert [p.report.auditor_id for p in listed] == [validator.peer_id]
        assert not mode.due()
        now[0] += 600
        assert mode.due()
        stop = threading.Event()
        stop.set()   # SIGTERM: no job is audited, the next audit is scheduled
        assert mode.run([honest], stop) == [] and not mode.due()
        with pytest.raises(ValueError):
            AuditMode(validator, 0)
    finally:
        dht.shutdown()


def test_the_version_at_the_retention_floor_is_not_a_mismatch(tmp_path, model_cache) -> None:
    """An honest trainer that pruned old deltas serves the floor version as a snapshot; an audit
    of every kept version (`--adapters all`, the validator's audit mode) flagged it
    adapter_mismatch (the snapshot's bytes are not the delta's). Only the hash counts there."""
    from swarmrl.node.audit.books import AuditPlan, audit_job
    from swarmrl.node.audit.client import AuditClient

    trainer = Trainer(TrainerConfig(state_dir=tmp_path / "t", cache_dir=model_cache, keep_versions=2, keep_snapshots=1),
                      Identity.generate())
    job, stores = run_tiny_job(trainer, tmp_path / "receipts", steps=8)
    server, port = serve(trainer, "127.0.0.1", 0, 4)
    try:
        floor = job.store.oldest_kept()
        assert floor > 0 and job.store.delta(floor) is None   # pruned: the floor is served as a snapshot
        client = AuditClient(f"127.0.0.1:{port}")
        report = audit_job(client, job.job_id, AuditPlan(sample=0, adapters=None), Identity.generate())
        client.close()
        assert [(f.reason, f.version) for f in report.findings] == []
    finally:
        server.stop(0)
        for s in stores:
            s.close()
        trainer.ledger.close()
