"""Signed receipts end to end: a real trainer job runtime (tiny model) answers an admitted batch
with a receipt that verifies against the trainer's key and is kept in the worker's store, and a
refused batch carries none; a real worker session against an in-process trainer keeps every
receipt, refuses a receipt a man in the middle re-signed (and keeps working), and
`swarmrl worker --credit` prints the credit from them."""

from __future__ import annotations

from pathlib import Path

from swarmrl.node.cli import main as cli
from swarmrl.node.inference import build_backend
from swarmrl.node.local.inprocess import InProcessTrainer
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.net.trainer_client import WorkerTrainer
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.worker.receipts import ReceiptStore, receipts_path
from swarmrl.node.worker.session import JobSession
from swarmrl.protocol import admission as adm
from swarmrl.protocol import receipts as rc
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_trainer_job import _honest_batch, _lease, _submit, clock, runtime  # noqa: F401 - fixtures


def test_an_admitted_batch_yields_a_receipt_that_verifies_and_is_stored(runtime, tmp_path) -> None:  # noqa: F811
    job, _, _ = runtime
    worker = Identity.from_seed(b"w" * 32)
    lease = _lease(job, worker)
    envelope = _honest_batch(job, worker, lease)
    answer = _submit(job, envelope)
    assert answer.accepted and [g.admitted for g in answer.groups] == [True]
    batch_id = signing.envelope_id(envelope)
    receipt = rc.verify_receipt(answer, pb.RolloutBatch.FromString(envelope.body), batch_id, job.identity.peer_id)
    assert list(receipt.admitted) == list(lease.prompt_indices) and receipt.groups == 1
    assert (receipt.job_id, receipt.peer_id, receipt.lease_id) == (job.job_id, worker.peer_id, lease.lease_id)
    assert receipt.policy_version == job.version and receipt.at_ms == job.admission.now_ms()

    store = ReceiptStore(receipts_path(tmp_path, worker.peer_id))
    assert store.add(answer.signed) and store.receipt(batch_id) == answer.signed
    [credit] = store.credit()
    assert (credit.job_id, credit.admitted, credit.batches) == (job.job_id, 1, 1)
    store.close()

    replay = _submit(job, envelope)   # refused as a whole: no signature handed out
    assert not replay.accepted and replay.reason == adm.REPLAY and not replay.HasField("signed")


class Resigning:
    """A man in the middle on the worker's link to the trainer (a drill): it passes every call to
    the real trainer client and, while `forge` is set, re-signs each answer's receipt with its own
    key, claiming every group admitted."""

    def __init__(self, real: WorkerTrainer, key: Identity) -> None:
        self.real, self.key, self.forge = real, key, False

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def submit_rollouts(self, envelope: pb.Signed) -> pb.BatchReceipt:
        answer = self.real.submit_rollouts(envelope)
        if self.forge and answer.accepted:
            receipt = pb.AdmissionReceipt.FromString(answer.signed.body)
            receipt.admitted[:] = [g.prompt_index for g in pb.RolloutBatch.FromString(envelope.body).groups]
            answer.signed.CopyFrom(rc.sign_receipt(self.key, receipt))
        return answer


def test_a_worker_session_keeps_its_receipts_refuses_a_forged_one_and_prints_its_credit(
        tmp_path: Path, model_cache: Path, capsys) -> None:
    cfg = TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache)
    trainer = InProcessTrainer(cfg, Identity.generate())
    spec = builtin_job("tiny", model_cache, steps=2, batch_groups=16, prompts_per_lease=2)
    ack = trainer.submit_job(sign_job(Identity.generate(), spec))
    assert ack.accepted, ack.reason
    backend = build_backend("hf", prepare_base_model("tiny", model_cache))
    backend.add_slot(ack.job_id, spec.lora)
    key_path = tmp_path / "worker.key"
    worker = Identity.load_or_create(key_path)
    store = ReceiptStore(receipts_path(tmp_path / "cache", worker.peer_id))
    record = trainer.record(ack.job_id)
    link = Resigning(trainer.connect(record), Identity.from_seed(b"m" * 32))
    session = JobSession(record, link, identity=worker, backend=backend,  # type: ignore[arg-type]
                         max_prompts=2, grade_timeout_s=30, receipts=store)
    try:
        rounds = [session.work_once() for _ in range(2)]
        assert all(r is not None and r.admitted == 2 for r in rounds)
        assert session.stats.receipts_kept == 2 and not session.stats.receipts_refused
        link.forge = True
        forged = session.work_once()   # admitted at the trainer, but its receipt is not the trainer's
        assert forged is not None and forged.admitted == 2
        assert session.stats.receipts_refused == {rc.WRONG_TRAINER: 1} and session.stats.receipts_kept == 2
        link.forge = False
        assert session.work_once() is not None and session.stats.receipts_kept == 3   # it kept serving
    finally:
        session.close()
        trainer.close()
    [credit] = store.credit()
    assert (credit.job_id, credit.admitted, credit.groups, credit.batches, credit.trainers) == (ack.job_id, 6, 6, 3, 1)
    store.close()

    argv = ["worker", "--credit", "-o", f'key="{key_path}"', "-o", f'cache_dir="{tmp_path / "cache"}"']
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"worker {worker.peer_id}: credit from trainer-signed receipts")
    assert out.splitlines()[1].startswith(f"job {ack.job_id}: 6 groups admitted of 6 sent, 3 batches, 1 trainer, "), out


def test_credit_of_a_worker_without_receipts_or_with_a_broken_file(tmp_path: Path, capsys) -> None:
    key_path = tmp_path / "worker.key"
    worker = Identity.load_or_create(key_path)
    argv = ["worker", "--credit", "-o", f'key="{key_path}"', "-o", f'cache_dir="{tmp_path}"']
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith(f"worker {worker.peer_id}: no receipts yet")
    path = receipts_path(tmp_path, worker.peer_id)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a database, " * 64)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is not a receipts file" in err[0], err
