"""A finished job's credit is whole: the last step lists the groups still pending as dropped
(`job_done`), and the job admits no batch after it (a batch arriving late is refused with reason
`job_done` and gets no receipt), so every receipt of a finished job is in its statements. Before
this, a batch answering a lease taken before the end was admitted after the last step: its
groups stayed pending for ever, in no statement, and its receipt promised credit no one gave."""

from __future__ import annotations

import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JOB_DONE, JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import audit, credit, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_red_team import _group
from tests.unit.test_trainer_job import FakeClock, _lease


def _batch(job: JobRuntime, who: Identity, lease: pb.Lease) -> pb.Signed:
    groups = [_group(i, job.prompt_ids(i), version=lease.policy_version, n=job.spec.group_size)
              for i in lease.prompt_indices]
    for g in groups:
        g.completions[0].reward = 1.0   # a spread of rewards: the step has a signal
    body = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=who.peer_id, groups=groups)
    return signing.sign(who, signing.ROLLOUT_BATCH, body)


def test_a_finished_jobs_receipts_are_all_in_its_statements(tmp_path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=1, batch_groups=2, group_size=2, prompts_per_lease=1)
    trainer = Identity.from_seed(b"t" * 32)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-done", spec, identity=trainer, model_path=prepare_base_model("tiny", model_cache),
                     state_dir=tmp_path, ledger=ledger, clock=FakeClock())
    peers = [Identity.from_seed(bytes([97 + i]) * 32) for i in range(4)]
    leases = [_lease(job, p) for p in peers]
    signed = []
    for p, lease in zip(peers[:3], leases[:3], strict=True):   # three admitted groups; a step takes two
        answer = job.admission.admit(_batch(job, p, lease), 1 << 24)
        assert answer.accepted and answer.groups[0].admitted
        signed.append(answer.signed)
    assert job.ready()
    job.train_step()
    assert job.done

    late = job.admission.admit(_batch(job, peers[3], leases[3]), 1 << 24)   # its lease was taken before the end
    assert not late.accepted and late.reason == adm.JOB_DONE and not late.HasField("signed")
    assert ledger.count_pending(job.job_id) == 0

    chain = credit.verify_chain(ledger.statements(job.job_id, 0, 10), job_id=job.job_id, trainer_id=trainer.peer_id)
    assert [st.version for st in chain] == [1] and chain[0].groups == 2
    assert [(d.peer_id, d.reason) for d in chain[0].dropped] and all(d.reason == JOB_DONE for d in chain[0].dropped)
    found, checked, pending = audit.check_receipts(signed, chain, job_id=job.job_id, trainer_id=trainer.peer_id,
                                                   max_async_level=spec.max_async_level, final_version=1)
    assert (found, checked, pending) == ([], 3, 0)
    ledger.close()
