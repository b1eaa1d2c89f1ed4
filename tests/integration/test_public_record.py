"""The public credit record (issue 27 item 2): a real trainer (hosting.Trainer behind its gRPC
server, the tiny job trained from two workers' signed batches) serves its signed statements over
hivemind's libp2p streams and announces its head in the DHT; a validator in audit mode audits
it and mirrors the chain it verified; `swarmrl audit JOB --initial-peers MADDR` audits from the
public record alone, from the trainer or, when the trainer no longer serves, from the mirror;
a holder that lies about its head or signs another's record is skipped; with the trainer gone,
the chain and the workers' receipts are still checked."""

from __future__ import annotations

import json

import pytest
from hivemind.utils import get_dht_time

from swarmrl.node.audit.books import AuditPlan, audit_job
from swarmrl.node.audit.public import PublicBooks
from swarmrl.node.cli.main import main
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.swarm.dht import VerifiedRecord, announce_job, start_dht
from swarmrl.node.swarm.statement_gossip import ChainError, StatementGossip, StatementMirror
from swarmrl.node.swarm.statement_records import announce_statements, find_statement_sources, statements_key
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.main import statement_source
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import credit, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.audits import AuditMode
from swarmrl.validator.mirror import ChainMirror
from tests.integration.test_audit import run_tiny_job

pytestmark = pytest.mark.integration


class Record:
    """The swarm of this file: the trainer's DHT node (the bootstrap), its gRPC server and its
    statement gossip; a validator's DHT node with its audit mode and chain mirror."""

    def __init__(self, tmp, model_cache) -> None:
        cfg = TrainerConfig(state_dir=tmp / "trainer", cache_dir=model_cache)
        self.trainer = Trainer(cfg, Identity.from_seed(b"P" * 32))
        self.job, self.stores = run_tiny_job(self.trainer, tmp / "receipts")
        self.receipts = tmp / "receipts"
        self.server, port = serve(self.trainer, "127.0.0.1", 0, 16)
        self.endpoint = f"127.0.0.1:{port}"
        self.dht = start_dht()
        self.peers = [str(a) for a in self.dht.get_visible_maddrs()]
        me = self.trainer.identity
        self.gossip = StatementGossip(self.dht, me, statement_source(self.trainer, me.peer_id))
        self.record = self.job.record(self.endpoint)
        self.record.maddrs[:] = self.peers
        assert announce_job(self.dht, me, self.record)
        version, sha = self.job.statements.head()
        self.gossip.announce(self.job.job_id, me.peer_id, version, sha, self.job.statements.count())
        self.validator_dht = start_dht(self.peers)
        self.validator = Identity.generate()
        self.mirror = ChainMirror(self.validator_dht, self.validator)
        self.audits = AuditMode(self.validator, 600, sample=0, mirror=self.mirror)
        self.reader = StatementGossip(self.validator_dht, Identity.generate(), dialable=False)   # reads only

    def close(self) -> None:
        self.reader.shutdown()
        self.mirror.shutdown()
        self.gossip.shutdown()
        self.server.stop(0)
        self.validator_dht.shutdown()
        self.dht.shutdown()
        for s in self.stores:
            s.close()
        self.trainer.ledger.close()


@pytest.fixture(scope="module")
def rec(tmp_path_factory, model_cache):
    r = Record(tmp_path_factory.mktemp("public_record"), model_cache)
    yield r
    r.close()


def _audit(capsys, r: Record, *extra: str) -> tuple[int, dict, str]:
    code = main(["audit", r.job.job_id, "--initial-peers", *r.peers, "--sample", "0", "--json", *extra])
    got = capsys.readouterr()
    return code, json.loads(got.out) if got.out.strip() else {}, got.err


def test_the_trainer_serves_its_statements_peer_to_peer_and_the_audit_reads_them(rec: Record, capsys) -> None:
    sources = find_statement_sources(rec.dht, rec.job.job_id)
    me = rec.trainer.identity.peer_id
    assert [(s.holder_id, s.trainer_id, s.head_version, s.statements) for s in sources] == [
        (me, me, rec.job.version, rec.job.version)]
    chain = rec.reader.chain_from(sources[0], rec.job.job_id)
    assert chain == rec.trainer.ledger.statements(rec.job.job_id, 0, 100) and rec.gossip.served[rec.job.job_id] >= 3
    code, report, err = _audit(capsys, rec, "--receipts", str(rec.receipts))
    assert code == 0 and report.get("findings", []) == [], report
    assert int(report["statements"]) == rec.job.version and int(report["batchesChecked"]) == 6
    assert int(report["receiptsChecked"]) > 0 and report["trainerId"] == me
    assert "statements from the trainer over libp2p" in err


def test_a_validator_in_audit_mode_mirrors_what_it_verified(rec: Record) -> None:
    t = rec.trainer.identity
    [result] = rec.audits.run([VerifiedRecord(rec.record, t.peer_id, t.public_key)])
    assert result.findings == 0 and result.signed is not None
    assert rec.mirror.store.head(rec.job.job_id, t.peer_id) == (
        rec.job.version, rec.job.statements.head()[1], rec.job.version)
    sources = find_statement_sources(rec.dht, rec.job.job_id)
    assert {s.holder_id for s in sources} == {t.peer_id, rec.validator.peer_id} and sources[0].is_trainer
    books = PublicBooks(rec.dht, rec.job.job_id)
    try:
        books.sources = [s for s in books.sources if not s.is_trainer]   # the mirror only
        report = audit_job(books, rec.job.job_id, AuditPlan(sample=0), Identity.generate(), record=books.record)
        assert list(report.findings) == [] and report.statements == rec.job.version and report.batches_checked == 6
        assert books.holder is not None and books.holder.holder_id == rec.validator.peer_id
    finally:
        books.close()


def test_a_lying_holder_is_skipped_and_a_record_in_anothers_name_dropped(rec: Record) -> None:
    t = rec.trainer.identity
    liar, liar_dht = Identity.generate(), start_dht(rec.peers)
    store = StatementMirror()
    store.keep(rec.job.job_id, t.peer_id, rec.trainer.ledger.statements(rec.job.job_id, 0, 100)[:-1])
    gossip = StatementGossip(liar_dht, liar, store.page)
    try:   # it serves the chain without its head, and announces the real head's version
        version, sha = rec.job.statements.head()
        assert announce_statements(liar_dht, liar, job_id=rec.job.job_id, trainer_id=t.peer_id, head_version=version + 5,
                                   head_sha256=sha, statements=9, libp2p_peer_id=gossip.libp2p_peer_id,
                                   maddrs=gossip.maddrs, now_ms=1)
        mallory = Identity.generate()   # a record in the trainer's name (subkey), signed by another key
        forged = pb.StatementHolder(job_id=rec.job.job_id, holder_id=t.peer_id, trainer_id=t.peer_id,
                                    head_version=version, head_sha256=sha, libp2p_peer_id=gossip.libp2p_peer_id,
                                    maddrs=gossip.maddrs)
        rec.dht.store(statements_key(rec.job.job_id), signing.sign(mallory, signing.STATEMENT_HOLDER,
                                                                   forged).SerializeToString(),
                      expiration_time=get_dht_time() + 60, subkey=f"{mallory.peer_id}:{t.peer_id}")
        sources = find_statement_sources(rec.dht, rec.job.job_id)
        assert sources[0].holder_id == liar.peer_id and mallory.peer_id not in {s.holder_id for s in sources}
        with pytest.raises(ChainError, match="announced head version"):
            rec.reader.chain_from(sources[0], rec.job.job_id)
        books = PublicBooks(rec.dht, rec.job.job_id)
        try:
            chain = books.statements(rec.job.job_id)
            assert credit.statement_sha256(chain[-1]) == sha and books.holder is not None
            assert books.holder.holder_id != liar.peer_id and books.holders_tried[0].startswith(liar.peer_id[:16])
        finally:
            books.close()
    finally:
        gossip.shutdown()
        liar_dht.shutdown()


def test_the_ladder_runs_in_the_public_record_audit(rec: Record, capsys, model_cache) -> None:
    """--recheck from the public record: the base model named by the job record, the batches from
    the trainer's endpoint; run_tiny_job's rollouts are made up (worker-signed), so every credited
    batch fails the ladder."""
    code, report, _ = _audit(capsys, rec, "--recheck", "--cache-dir", str(model_cache))
    assert code == 1 and [f["reason"] for f in report["findings"]] == ["failed_recheck"] * 6, report


def test_misuse_is_one_line_and_exit_2(rec: Record, capsys) -> None:
    assert main(["audit", "no-such-job", "--initial-peers", *rec.peers]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no job record and no statement holder" in err[0]
    assert main(["audit", rec.job.job_id]) == 2
    assert "--initial-peers MADDR is required" in capsys.readouterr().err


def test_with_the_trainer_gone_the_mirror_serves_and_the_receipts_are_checked(rec: Record, capsys) -> None:
    """Last in the file: the trainer stops serving statements and gRPC (its records stay in the DHT
    until they expire, as after a crash)."""
    rec.audits.run([VerifiedRecord(rec.record, rec.trainer.identity.peer_id, rec.trainer.identity.public_key)])
    rec.gossip.shutdown()
    rec.server.stop(0)
    code, report, err = _audit(capsys, rec, "--receipts", str(rec.receipts))
    assert code == 0 and report.get("findings", []) == [], report
    assert int(report["statements"]) == rec.job.version and int(report.get("batchesChecked", 0)) == 0
    assert int(report["batchesUnavailable"]) == 6 and int(report["receiptsChecked"]) > 0
    assert f"statements from mirror {rec.validator.peer_id[:16]}" in err and "holder(s) failed" in err
