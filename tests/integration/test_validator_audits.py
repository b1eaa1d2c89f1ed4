"""A validator in audit mode runs its ladder on the credited batches an audit samples
(validator/audits.py, `ValidatorService.recheck_for`): the books' checks pass for a trainer that
credits made-up rollouts signed by its own (sybil) worker keys, and only the re-checks catch it.

Honest: a real worker session (the tiny model, transformers) against an in-process trainer that
also serves gRPC for the audit; every credited group re-graded and re-scored: no finding, and the
worker's reputation at the validator is untouched. Made up: the trainer of tests/integration/
test_audit.py, whose batches carry invented tokens and log-probs: every sampled batch is
`failed_recheck`, naming its worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swarmrl.node.audit.client import AuditClient
from swarmrl.node.cli.main import main
from swarmrl.node.inference import build_backend
from swarmrl.node.local.inprocess import InProcessTrainer
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime.config import TrainerConfig, ValidatorConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.service import serve
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol import audit, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.audits import AuditMode
from swarmrl.validator.service import ValidatorService
from tests.integration.test_audit import WORKERS, run_tiny_job

pytestmark = pytest.mark.integration


def _validator(tmp_path: Path, model_cache: Path, connect=None) -> tuple[ValidatorService, Identity]:
    key = Identity.generate()
    cfg = ValidatorConfig(key=tmp_path / "v.key", state_dir=tmp_path / "validator", cache_dir=model_cache,
                          sample_rate=0.25, device="cpu")
    return ValidatorService(cfg, key, connect=connect), key


def test_honest_rollouts_pass_the_ladder_inside_the_audit(tmp_path: Path, model_cache: Path, capsys) -> None:
    trainer = InProcessTrainer(TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache, probation_s=0),
                               Identity.generate())
    spec = builtin_job("tiny", model_cache, steps=2, batch_groups=2, prompts_per_lease=2)
    ack = trainer.submit_job(sign_job(Identity.generate(), spec))
    assert ack.accepted, ack.reason
    job = trainer.trainer.jobs[ack.job_id]
    backend = build_backend("hf", prepare_base_model("tiny", model_cache))
    backend.add_slot(ack.job_id, spec.lora)
    worker = Identity.generate()
    record = trainer.record(ack.job_id)
    session = JobSession(record, trainer.connect(record), identity=worker, backend=backend,
                         max_prompts=spec.prompts_per_lease, grade_timeout_s=30)
    server, port = serve(trainer.trainer, "127.0.0.1", 0, 4)   # the audit reads the books over gRPC
    service, key = _validator(tmp_path, model_cache, connect=trainer.connect)
    try:
        while job.version < 1:   # real rollouts until a batch with signal trains a version
            assert job.batches_without_signal <= 20
            assert session.work_once() is not None, session.last_refusal
            trainer.step()
        mode = AuditMode(key, 600, sample=0, recheck_for=service.recheck_for,
                         client_for=lambda r: AuditClient(f"127.0.0.1:{port}"))
        [result] = mode.run([trainer.verified_record(ack.job_id)])
        assert result.signed is not None and result.findings == 0, mode.findings
        body, _ = signing.open_signed(result.signed, signing.AUDIT_REPORT, pb.AuditReport)
        assert body.batches_checked >= 1 and body.statements == job.version
        print(f"honest: {body.statements} statements, {body.batches_checked} credited batches re-checked, no finding")
        assert service.reputation.peers() == []   # an audit's recheck records nothing against the worker
        # the same ladder run by `swarmrl audit --recheck` itself (the base model from --cache-dir)
        capsys.readouterr()
        code = main(["audit", ack.job_id, "--trainer", f"127.0.0.1:{port}", "--recheck", "--cache-dir",
                     str(model_cache), "--sample", "0", "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0 and report.get("findings", []) == [] and int(report["batchesChecked"]) >= 1, report
    finally:
        server.stop(0)
        session.close()
        service.close()
        trainer.close()


def test_a_trainer_crediting_made_up_rollouts_is_named_by_the_recheck(tmp_path: Path, model_cache: Path,
                                                                     capsys) -> None:
    trainer = Trainer(TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache), Identity.generate())
    job, stores = run_tiny_job(trainer, tmp_path / "receipts")   # invented tokens and log-probs, worker-signed
    server, port = serve(trainer, "127.0.0.1", 0, 4)
    endpoint = f"127.0.0.1:{port}"
    service, key = _validator(tmp_path, model_cache)
    try:
        rec = VerifiedRecord(job.record(endpoint), trainer.identity.peer_id, trainer.identity.public_key)
        books_only = AuditMode(key, 600, sample=0)
        [plain] = books_only.run([rec])
        assert plain.findings == 0   # signatures, chain and counts all add up
        mode = AuditMode(key, 600, sample=0, recheck_for=service.recheck_for)
        [result] = mode.run([rec])
        body, _ = signing.open_signed(result.signed, signing.AUDIT_REPORT, pb.AuditReport)
        assert result.findings == body.batches_checked == 6 and set(mode.findings) == {audit.FAILED_RECHECK}
        print("made up:", [f.detail for f in body.findings][:2])
        assert {f.peer_id for f in body.findings} == {w.peer_id for w in WORKERS}
        audit_cmd = ["audit", job.job_id, "--trainer", endpoint, "--sample", "0", "--json"]
        assert main(audit_cmd) == 0   # `swarmrl audit`: the books add up ...
        capsys.readouterr()
        assert main([*audit_cmd, "--recheck", "--cache-dir", str(model_cache)]) == 1   # ... the ladder does not
        report = json.loads(capsys.readouterr().out)
        assert [f["reason"] for f in report["findings"]] == [audit.FAILED_RECHECK] * 6, report
    finally:
        server.stop(0)
        for s in stores:
            s.close()
        service.close()
        trainer.ledger.close()
