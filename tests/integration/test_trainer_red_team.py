"""Trainers in the red team (issue 27 item 4): a real trainer (hosting.Trainer behind its gRPC
server on loopback, the tiny job, two workers' signed batches through its admission, real
steps) run with each of its cheating modes, audited by `swarmrl audit` with the workers'
receipts: each mode is flagged with its named reason, and no finding names an honest worker as
the one credited for what it did not do."""

from __future__ import annotations

import json

import pytest

from swarmrl.node.cli.main import main
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.red_team import SYBIL_PROMPT_BASE, StatementDrill
from swarmrl.node.trainer.service import serve
from swarmrl.protocol import audit, credit
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.red_team_modes import MISSTATED_ADAPTER, OMIT_GROUPS, SYBIL_CREDIT, TRAINER_MODES
from tests.integration.test_audit import WORKERS, run_tiny_job

pytestmark = pytest.mark.integration
EXPECTED = {OMIT_GROUPS: audit.OMITTED_GROUP, SYBIL_CREDIT: audit.UNKNOWN_BATCH,
            MISSTATED_ADAPTER: credit.ADAPTER_MISMATCH}


@pytest.mark.parametrize("mode", TRAINER_MODES)
def test_each_cheating_trainer_is_flagged_with_its_reason(mode, tmp_path, model_cache, capsys) -> None:
    trainer = Trainer(TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache, red_team=mode),
                      Identity.from_seed(b"R" * 32))
    job, stores = run_tiny_job(trainer, tmp_path / "receipts")
    server, port = serve(trainer, "127.0.0.1", 0, 16)
    try:
        code = main(["audit", job.job_id, "--trainer", f"127.0.0.1:{port}", "--sample", "0", "--json",
                     "--receipts", str(tmp_path / "receipts")])
        report = json.loads(capsys.readouterr().out)
        trained = sum(int(r["groups_trained"]) for r in trainer.ledger.steps(job.job_id))
    finally:
        server.stop(0)
        for s in stores:
            s.close()
        trainer.ledger.close()
    findings = report.get("findings", [])
    assert code == 1 and findings, report
    assert {f["reason"] for f in findings} == {EXPECTED[mode]}, findings
    honest = {w.peer_id for w in WORKERS}
    drill = StatementDrill(mode, job.job_id)
    if mode == OMIT_GROUPS:   # the wronged worker is named, with the batch its receipt proves
        assert {f["peerId"] for f in findings} == {min(honest)} and all(f.get("batchId") for f in findings)
    elif mode == SYBIL_CREDIT:   # the credit went to the trainer's own key, one batch per version
        assert {f["peerId"] for f in findings} == {drill.sybil.peer_id} and len(findings) == job.version
    else:
        assert all("peerId" not in f for f in findings)
    # the ledger kept the truth: every worker's groups were trained (only the public books lie)
    assert trained == 2 * job.version


def test_the_drill_changes_only_what_its_mode_names() -> None:
    groups = [credit.ConsumedGroup(batch_id="ab" * 32, peer_id=p, prompt_index=i, tokens=10)
              for i, p in enumerate(["p2", "p1", "p2"])]
    omit = StatementDrill(OMIT_GROUPS, "job")
    assert [g.peer_id for g in omit.trained(1, groups)] == ["p2", "p2"]   # victim: the lowest peer id, p1
    assert omit.trained(2, []) == [] and [g.peer_id for g in omit.trained(3, groups[1:2])] == []
    sybil = StatementDrill(SYBIL_CREDIT, "job")
    out = sybil.trained(4, groups)
    assert out[:3] == groups and out[3].peer_id == sybil.sybil.peer_id and out[3].prompt_index == SYBIL_PROMPT_BASE + 4
    assert sybil.trained(5, []) == []   # nothing credited: nothing to hide a sybil among
    from swarmrl.protocol.pb import swarm_pb2 as pb

    update = pb.AdapterUpdate(to_version=2, from_hash=b"a" * 32, to_hash=b"b" * 32, payload_sha256=b"c" * 32)
    lie = StatementDrill(MISSTATED_ADAPTER, "job").update(update)
    assert lie.to_hash == b"a" * 32 and update.to_hash == b"b" * 32 and lie.payload_sha256 == update.payload_sha256
    assert StatementDrill(MISSTATED_ADAPTER, "job").trained(1, groups) == groups
    with pytest.raises(ValueError, match="unknown trainer red-team mode"):
        StatementDrill("generous", "job")
