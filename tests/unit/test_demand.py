"""Demand in the signed job record (issue 24 items 1 and 3, "Bad input"): the trainer promises no
more than it can train before the work goes stale (open leases count against its backlog), signs
capacity, intake and weight into its record, refuses a job weight above its cap at submit time;
workers ignore records whose demand is missing, negative or absurd.

Time is driven through the runtime's injected clock (`FakeClock`): no test sleeps."""

from __future__ import annotations

import math

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.hosting import Trainer
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.demand import IntakeMeter, check_demand, open_capacity, window_groups
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _lease, _submit


@pytest.fixture()
def job(tmp_path, model_cache):
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=10, batch_groups=2, prompts_per_lease=2, max_async_level=1,
                       lease_ttl_s=60, weight=2.0)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    clock = FakeClock()
    runtime = JobRuntime("job-demand", spec, identity=Identity.from_seed(b"t" * 32),
                         model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger,
                         clock=clock)
    yield runtime, clock
    ledger.close()


def _ask(job: JobRuntime, who: Identity, n: int = 2) -> pb.LeaseReply:
    return job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=n))


def test_open_leases_count_against_the_backlog(job) -> None:
    job, clock = job
    assert window_groups(job.spec) == 4                   # (max_async_level 1 + 1) x 2 groups per step
    assert job.admission.capacity() == 4
    a, b, c = (Identity.from_seed(bytes([x]) * 32) for x in b"abc")
    assert len(_ask(job, a).lease.prompt_indices) == 2    # nothing pending yet: every lease is a promise
    assert job.admission.capacity() == 2
    assert len(_ask(job, b, n=4).lease.prompt_indices) == 2   # granted only what is left of the promise
    refused = _ask(job, c)
    assert refused.reason == "busy" and refused.retry_after_ms > 0 and job.admission.capacity() == 0
    clock.advance(61)                                     # the open leases expire: the promise is free again
    assert job.admission.capacity() == 4
    lease = _lease(job, c)                                # one prompt answered -> one pending group
    assert _submit(job, _honest_batch(job, c, lease)).groups[0].admitted
    assert job.admission.capacity() == 3                  # pending groups count as open leases did


def test_the_record_carries_capacity_intake_and_weight(job) -> None:
    job, clock = job
    d = job.record("127.0.0.1:1").demand
    assert (d.capacity, d.intake_per_min, d.weight) == (4, 0.0, 2.0)
    who = Identity.from_seed(b"w" * 32)
    for _ in range(2):
        assert _submit(job, _honest_batch(job, who, _lease(job, who))).groups[0].admitted
    assert job.record("x").demand.capacity == 2
    assert job.ready()
    job.train_step()                                      # consumed: trained, or without signal (both intake)
    assert job.ledger.count_pending(job.job_id) == 0
    clock.advance(1)
    d = job.record("x").demand
    assert d.capacity == 4 and d.intake_per_min == pytest.approx(2.0)   # 2 groups in the last 60 s
    assert check_demand(job.record("x"), job.spec) == ""


def test_the_intake_meter_counts_the_last_window() -> None:
    meter = IntakeMeter(window_s=60)
    meter.add(0.0, 8)
    meter.add(30.0, 4)
    assert meter.per_minute(30.0) == 12.0
    assert meter.per_minute(61.0) == 4.0                  # the first step left the window
    assert meter.per_minute(200.0) == 0.0
    with pytest.raises(ValueError):
        IntakeMeter(window_s=0)


def test_capacity_is_never_negative(model_cache) -> None:
    spec = builtin_job("tiny", model_cache, batch_groups=[2, 8], max_async_level=2)
    assert window_groups(spec) == 24
    assert open_capacity(spec, pending_groups=20, open_prompts=10) == 0
    assert open_capacity(spec, pending_groups=3, open_prompts=5) == 16


@pytest.mark.parametrize(("field", "value", "why"), [
    ("capacity", -1, "negative"),
    ("capacity", 25, "above the lease book's bound 24"),
    ("intake_per_min", -0.5, "intake"),
    ("intake_per_min", math.nan, "intake"),
    ("intake_per_min", 1e12, "intake"),
    ("weight", 0.0, "not a positive number"),
    ("weight", math.inf, "not a positive number"),
    ("weight", 3.0, "above the job's own weight 2"),
])
def test_workers_ignore_absurd_demand(model_cache, field: str, value: float, why: str) -> None:
    spec = builtin_job("tiny", model_cache, batch_groups=8, max_async_level=2, weight=2.0)
    rec = pb.JobRecord(job_id="j", spec_json=spec.canonical_json(),
                       demand=pb.Demand(capacity=24, intake_per_min=10.0, weight=2.0))
    assert check_demand(rec, spec) == ""
    setattr(rec.demand, field, value)
    assert why in check_demand(rec, spec)


def test_missing_demand_and_a_weight_above_the_workers_cap_are_ignored(model_cache) -> None:
    spec = builtin_job("tiny", model_cache, weight=5.0)
    assert "no demand" in check_demand(pb.JobRecord(job_id="j"), spec)
    rec = pb.JobRecord(job_id="j", demand=pb.Demand(capacity=1, weight=5.0))
    assert check_demand(rec, spec, max_weight=4.0) == "weight 5 is above the cap 4"


def test_a_job_weight_above_the_trainers_cap_is_refused_at_submit(tmp_path, model_cache) -> None:
    alice, bob = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
    cfg = TrainerConfig(state_dir=tmp_path / "t", cache_dir=model_cache, max_job_weight=1.5,
                        submitter_weight_caps={alice.peer_id: 4.0})
    trainer = Trainer(cfg, Identity.from_seed(b"t" * 32))
    try:
        spec = builtin_job("tiny", model_cache, steps=2, weight=3.0)
        ack = trainer.submit_job(sign_job(bob, spec))
        assert not ack.accepted
        assert ack.reason == (f"job weight 3 is above this trainer's cap 1.5 for submitter {bob.peer_id} "
                              "(max_job_weight, submitter_weight_caps)")
        assert "\n" not in ack.reason and ack.job_id not in trainer.jobs
        ack = trainer.submit_job(sign_job(alice, spec))   # alice's cap is 4
        assert ack.accepted, ack.reason
        assert trainer.jobs[ack.job_id].record("x").demand.weight == 3.0
    finally:
        trainer.ledger.close()
    lowered = TrainerConfig(state_dir=tmp_path / "t", cache_dir=model_cache, max_job_weight=1.5)
    again = Trainer(lowered, Identity.from_seed(b"t" * 32))   # a restart under a lower cap: the job stays, capped
    try:
        assert again.jobs[ack.job_id].record("x").demand.weight == 1.5
    finally:
        again.ledger.close()
