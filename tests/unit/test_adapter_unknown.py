"""Content-addressed versions at admission: a completion that names the adapter hash the trainer
published as its version is admitted; one naming a hash it never published (another trainer's
DiLoCo inner version under the same number, or garbage) is refused as `adapter_unknown`, without
a strike (an honest worker can hold a cotrainer's version), and one naming nothing is checked as
before."""

from __future__ import annotations

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_done_job_credit import _batch
from tests.unit.test_trainer_job import FakeClock, _lease


def _named(signed: pb.Signed, who: Identity, adapter_hash: bytes) -> pb.Signed:
    body = pb.RolloutBatch.FromString(signed.body)
    for g in body.groups:
        for c in g.completions:
            c.adapter_hash = adapter_hash
    return signing.sign(who, signing.ROLLOUT_BATCH, body)


def test_admission_checks_the_named_adapter_hash(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=2, batch_groups=4, group_size=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-hash", spec, identity=Identity.from_seed(b"t" * 32),
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger,
                     clock=FakeClock())
    peers = [Identity.from_seed(bytes([97 + i]) * 32) for i in range(3)]
    right, wrong, unnamed = (_lease(job, p) for p in peers)
    ok = job.admission.admit(_named(_batch(job, peers[0], right), peers[0], job.head_hash), 1 << 24)
    assert ok.accepted and ok.groups[0].admitted
    refused = job.admission.admit(_named(_batch(job, peers[1], wrong), peers[1], bytes(32)), 1 << 24)
    assert refused.accepted and not refused.groups[0].admitted and refused.groups[0].reason == adm.ADAPTER_UNKNOWN
    short = job.admission.admit(_named(_batch(job, peers[1], wrong), peers[1], b"\x01"), 1 << 24)
    assert not short.groups[0].admitted and short.groups[0].reason == adm.ADAPTER_UNKNOWN
    assert job.admission.strikes[peers[1].peer_id] == 0 and peers[1].peer_id not in job.admission.banned
    plain = job.admission.admit(_batch(job, peers[2], unnamed), 1 << 24)
    assert plain.groups[0].admitted
    ledger.close()
