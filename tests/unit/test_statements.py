"""The trainer's contribution statements (node/trainer/statements.py) on a real tiny job: one per
version, chained, crediting exactly the groups each step trained (the sum is the groups trained
of the step rows), listing the groups consumed without credit, named by the job record, kept
across a restart, and never lost nor doubled by a crash between publishing and stating."""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JOB_DONE, NO_SIGNAL, JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import credit, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_red_team import _group
from tests.unit.test_trainer_job import FakeClock, _lease, _submit

TRAINER = Identity.from_seed(b"t" * 32)
ALICE, BOB = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)


def _open(tmp_path, model_cache, clock, steps: int = 6) -> tuple[JobRuntime, Ledger]:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=steps, batch_groups=2, group_size=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-credit", spec, identity=TRAINER, ledger=ledger, state_dir=tmp_path, clock=clock,
                     model_path=prepare_base_model("tiny", model_cache))
    return job, ledger


@pytest.fixture()
def opened(tmp_path, model_cache):
    clock = FakeClock()
    job, ledger = _open(tmp_path, model_cache, clock)
    yield job, ledger, clock
    ledger.close()


def _send(job: JobRuntime, who: Identity, rewards: tuple[float, float] = (0.0, 1.0)) -> pb.BatchReceipt:
    lease = _lease(job, who)
    group = _group(lease.prompt_indices[0], job.prompt_ids(lease.prompt_indices[0]), version=job.version, n=2)
    for c, r in zip(group.completions, rewards):
        c.reward = r
    batch = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=who.peer_id, groups=[group])
    receipt = _submit(job, signing.sign(who, signing.ROLLOUT_BATCH, batch))
    assert receipt.groups[0].admitted
    return receipt


def _chain(job: JobRuntime, ledger: Ledger) -> list[pb.ContributionStatement]:
    return credit.verify_chain(ledger.statements(job.job_id, 0, 1000), job_id=job.job_id, trainer_id=TRAINER.peer_id)


def test_each_version_gets_one_chained_statement_that_adds_up(opened) -> None:
    job, ledger, _ = opened
    receipts = []
    for _ in range(2):
        receipts += [_send(job, ALICE), _send(job, BOB)]
        assert job.ready() and job.train_step() is not None
    _send(job, ALICE, (1.0, 1.0))
    _send(job, BOB, (1.0, 1.0))
    assert job.ready() and job.train_step() is None            # no signal: consumed, no version
    receipts += [_send(job, ALICE), _send(job, BOB)]
    assert job.ready() and job.train_step() is not None
    chain = _chain(job, ledger)
    assert [s.version for s in chain] == [1, 2, 3] == list(range(1, job.version + 1))
    assert sum(s.groups for s in chain) == sum(int(r["groups_trained"]) for r in ledger.steps(job.job_id)) == 6
    credited = {p.peer_id: 0 for p in chain[0].peers}
    for s in chain:
        for p in s.peers:
            credited[p.peer_id] += p.groups
    assert credited == {ALICE.peer_id: 3, BOB.peer_id: 3}
    assert [d.reason for d in chain[2].dropped] == [NO_SIGNAL, NO_SIGNAL]   # stated by the next version
    for s in chain:
        credit.check_adapter(s, job.store.header(s.version))
    tokens = {bytes(b.batch_id).hex(): b.tokens for s in chain for b in s.batches}
    assert set(tokens) == {r.batch_id for r in receipts} and all(t == 4 for t in tokens.values())  # 2 x 2 tokens
    record = job.record("127.0.0.1:1")
    assert record.statement_version == 3
    assert record.statement_sha256 == credit.statement_sha256(ledger.last_statement(job.job_id))
    assert job.statements.fetch(1, 0) == ledger.statements(job.job_id, 1, 16) and len(job.statements.fetch(0, 1)) == 1


def test_a_restart_keeps_the_chain_and_a_crash_before_the_statement_loses_nothing(tmp_path, model_cache, monkeypatch) -> None:
    clock = FakeClock()
    job, ledger = _open(tmp_path, model_cache, clock)
    _send(job, ALICE), _send(job, BOB)
    assert job.ready() and job.train_step() is not None
    first = ledger.statements(job.job_id, 0, 10)
    # the next step publishes version 2, then the process dies before the statement is stored
    _send(job, ALICE), _send(job, BOB)
    monkeypatch.setattr(job.statements, "state", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
    assert job.ready()
    with pytest.raises(SystemExit):
        job.train_step()
    assert job.version == 2 and ledger.count_pending(job.job_id) == 2
    ledger.close()
    job, ledger = _open(tmp_path, model_cache, clock)               # resumes at version 2 from the store
    assert job.version == 2
    chain = _chain(job, ledger)
    assert ledger.statements(job.job_id, 0, 1) == first                # the first statement, unchanged
    assert [(s.version, s.groups) for s in chain] == [(1, 2), (2, 0)]  # the crashed version: stated empty
    assert job.ready() and job.train_step() is not None                # its groups, still pending, train now
    chain = _chain(job, ledger)
    assert [(s.version, s.groups) for s in chain] == [(1, 2), (2, 0), (3, 2)]
    before = ledger.statements(job.job_id, 0, 10)
    ledger.close()
    job, ledger = _open(tmp_path, model_cache, clock)                  # a clean restart writes nothing
    assert ledger.statements(job.job_id, 0, 10) == before and job.statements.head()[0] == 3
    again = credit.sign_statement(TRAINER, credit.build_statement(job.job_id, 3, pb.AdapterUpdate(), before[1],
                                                                  [], [], 1))
    assert ledger.record_statement(job.job_id, 3, again) == before[2]  # one version, one statement
    ledger.close()


def test_the_last_version_lists_the_groups_left_pending_as_dropped(tmp_path, model_cache) -> None:
    clock = FakeClock()
    job, ledger = _open(tmp_path, model_cache, clock, steps=1)
    _send(job, ALICE), _send(job, BOB)
    assert job.ready()
    batch = job.take_batch()
    left = _send(job, ALICE)                     # admitted while the last step runs
    job.take_batch = lambda: batch               # the step takes what it took before the late batch
    assert job.train_step() is not None and job.done
    (last,) = _chain(job, ledger)
    assert last.groups == 2 and [(d.reason, bytes(d.batch_id).hex()) for d in last.dropped] == [(JOB_DONE, left.batch_id)]
    assert ledger.count_pending(job.job_id) == 0
    ledger.close()
