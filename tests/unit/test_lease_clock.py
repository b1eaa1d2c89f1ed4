"""Leases on a clock that can't jump (issue 24): lease deadlines and expiry follow the trainer's
monotonic clock, so a wall clock stepped back or forward by an hour changes neither; a lease on the
wire still carries wall-clock times; a restart keeps at most one TTL of a lease's time.

Both clocks are injected (`FakeClock`): the wall clock steps, the monotonic one only advances.
"""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.leases import LeaseBook
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _lease, _submit

HOUR_S = 3600.0


@pytest.fixture()
def clocks(tmp_path, model_cache):
    """(job, wall, monotonic): a job runtime whose wall and lease clocks the test moves apart."""
    torch.manual_seed(0)
    wall, mono = FakeClock(), FakeClock(t=500.0)
    spec = builtin_job("tiny", model_cache, steps=4, batch_groups=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-clock", spec, identity=Identity.from_seed(b"t" * 32),
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, ledger=ledger,
                     clock=wall, monotonic=mono)
    yield job, wall, mono
    ledger.close()


def test_a_lease_carries_wall_clock_times(clocks) -> None:
    job, wall, _ = clocks
    lease = _lease(job, Identity.from_seed(b"a" * 32))
    assert lease.issued_ms == int(wall.t * 1000)
    assert lease.deadline_ms == lease.issued_ms + int(job.spec.lease_ttl_s * 1000)


def test_wall_clock_set_back_an_hour_still_expires_the_lease_on_time(clocks) -> None:
    """Before: the expired lease's prompt came back only an hour later (at +3,661 s with a 60 s TTL)."""
    job, wall, mono = clocks
    slow, other = Identity.from_seed(b"s" * 32), Identity.from_seed(b"o" * 32)
    lease = _lease(job, slow)
    late = _honest_batch(job, slow, lease)
    wall.advance(-HOUR_S)
    mono.advance(job.spec.lease_ttl_s + 1)
    again = _lease(job, other)
    assert list(again.prompt_indices) == list(lease.prompt_indices)   # re-issued at once
    assert job.admission.leases.get(lease.lease_id) is None
    assert _submit(job, late).reason == adm.LEASE_EXPIRED          # the late batch is told so


def test_wall_clock_set_forward_an_hour_expires_no_open_lease(clocks) -> None:
    """Before: every open lease expired at once and honest batches came back lease_expired."""
    job, wall, mono = clocks
    workers = [Identity.from_seed(bytes([65 + k]) * 32) for k in range(3)]
    leases = [_lease(job, w) for w in workers]
    wall.advance(HOUR_S)
    mono.advance(1.0)
    job.admission.expire_leases()
    assert all(job.admission.leases.get(lease.lease_id) is not None for lease in leases)
    receipts = [_submit(job, _honest_batch(job, w, lease)) for w, lease in zip(workers, leases, strict=True)]
    assert all(r.groups and r.groups[0].admitted for r in receipts), [r.reason for r in receipts]


def test_a_restart_keeps_what_was_left_of_a_lease_at_most_one_ttl() -> None:
    """Restored from the ledger after a restart, each open lease keeps deadline - wall now of its
    time on the new monotonic clock, clamped to [0, TTL]: a wall clock set back can't stretch it."""
    ttl, wall_ms, mono_ms = 60_000, 1_800_000_000_000, 7_000
    book = LeaseBook("J", ttl_ms=ttl)
    sampling = pb.SamplingParams(n=2)
    leases = [book.issue("p", 1, 0, sampling, 0, wall_ms=wall_ms + offset) for offset in (-50_000, 0, 3_600_000)]
    restored = LeaseBook("J", ttl_ms=ttl)
    restored.restore(leases, set(), now_ms=mono_ms, wall_ms=wall_ms)
    assert [restored.deadline_of(lease.lease_id) for lease in leases] == [mono_ms + 10_000, mono_ms + ttl,
                                                                          mono_ms + ttl]
    assert restored.expire(mono_ms + 10_001) == [leases[0].lease_id]
    assert restored.expired_recently(leases[0].lease_id) and not restored.expired_recently(leases[1].lease_id)
    assert sorted(restored.expire(mono_ms + ttl + 1)) == sorted(lease.lease_id for lease in leases[1:])
