"""Elastic intake (issue 24 item 4): a job declares its groups per step as a range
`batch_groups = [min, max]`; a step waits for `min` trainable groups and takes every pending one up
to `max`, so more supply makes larger batches instead of stale work; leases are refused ("busy")
once pending groups and open leases fill the staleness window of batches of `max`
(`protocol.demand.window_groups`). A plain number keeps its meaning and its job id.
"""

from __future__ import annotations

import pydantic
import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.demand import window_groups
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _lease, _submit


@pytest.fixture()
def elastic(tmp_path, model_cache):
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=10, batch_groups=[2, 5], prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-elastic", spec, identity=Identity.from_seed(b"t" * 32),
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger,
                     clock=FakeClock())
    yield job
    ledger.close()


def _admit(job: JobRuntime, n: int) -> None:
    for k in range(n):
        who = Identity.from_seed(bytes([97 + k % 20]) * 32)
        assert _submit(job, _honest_batch(job, who, _lease(job, who))).groups[0].admitted


def test_a_step_waits_for_min_and_takes_up_to_max(elastic) -> None:
    job = elastic
    assert (job.spec.batch_min, job.spec.batch_max) == (2, 5)
    _admit(job, 1)
    assert not job.ready()
    _admit(job, 1)
    assert job.ready() and len(job.take_batch()) == 2       # little supply: the minimum
    _admit(job, 5)                                          # 7 pending now
    assert len(job.take_batch()) == 5                       # more supply: up to the maximum


def test_backlog_counts_batches_of_max(elastic) -> None:
    job = elastic
    window = window_groups(job.spec)                       # (max_async_level + 1) batches of max
    assert window == (job.spec.max_async_level + 1) * 5
    _admit(job, window - 1)                                # one short of the window: still leasing
    who = Identity.from_seed(b"z" * 32)
    assert job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id)).HasField("lease")
    assert job.admission.request_lease(who.peer_id, pb.LeaseRequest(job_id=job.job_id)).reason == "busy"


def test_a_range_is_checked_and_a_number_keeps_its_json(model_cache) -> None:
    spec = builtin_job("tiny", model_cache, batch_groups=4)
    assert '"batch_groups":4' in spec.canonical_json()        # job ids of plain-number jobs don't change
    ranged = builtin_job("tiny", model_cache, batch_groups=[8, 64])
    assert '"batch_groups":[8,64]' in ranged.canonical_json()
    assert JobSpec.from_json(ranged.canonical_json()) == ranged
    data = spec.model_dump(mode="json")
    for bad in ([64, 8], [0, 8], [8, 5000], [8], [1, 2, 3]):
        with pytest.raises(pydantic.ValidationError, match="batch_groups"):
            JobSpec.model_validate(data | {"batch_groups": bad})
