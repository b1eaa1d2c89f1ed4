"""A real worker choosing between two jobs of a trainer in this process (issue 24 items 1-2 and
"Bad input"): a job whose trainer refuses as `busy` sends the worker to the other job at once
(no wait in between), the busy trainer is skipped for a while instead of being asked again in a
loop, and a record whose demand is missing or absurd is ignored with its reason.

The trainer is `node.local.inprocess.InProcessTrainer` (no socket); the worker is
`node.worker.main.Worker` with the tiny model on transformers, its job choice driven by
`Worker.work` with the records the trainer announces. Time is the market's injected clock."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmrl.node.local.inprocess import InProcessTrainer
from swarmrl.node.runtime.config import TrainerConfig, WorkerConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.worker.main import Worker
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb


class Stop(threading.Event):
    """A stop event that never blocks and records every wait (a wait is the worker idling)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return False


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def swarm(tmp_path: Path, model_cache: Path) -> Iterator[tuple[InProcessTrainer, Worker, str, str]]:
    """An in-process trainer with jobs A and B (on-policy, 2 groups per step: a window of 2
    prompts, one lease of 2 fills it) and a worker whose trainer clients are in-process."""
    trainer = InProcessTrainer(TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache),
                               Identity.generate())
    spec = builtin_job("tiny", model_cache, steps=3, batch_groups=2, prompts_per_lease=2, max_async_level=0)
    submitter = Identity.generate()
    a = trainer.submit_job(sign_job(submitter, spec)).job_id
    b = trainer.submit_job(sign_job(submitter, spec.model_copy(update={"seed": 1}))).job_id
    worker = Worker(WorkerConfig(base_model="tiny", cache_dir=model_cache, key=tmp_path / "w.key", poll_s=30,
                                 max_prompts=2, gossip=False),
                    Identity.generate(), connect=trainer.connect)
    worker.market.clock = Clock()
    try:
        yield trainer, worker, a, b
    finally:
        worker.close()
        trainer.close()


def _fill(trainer: InProcessTrainer, job_id: str) -> None:
    """Another peer leases everything job `job_id` promised (open leases count against its backlog)."""
    other = Identity.generate()
    req = pb.LeaseRequest(job_id=job_id, max_prompts=2)
    assert trainer.client().request_lease(signing.sign(other, signing.LEASE_REQUEST, req)).HasField("lease")
    assert trainer.trainer.jobs[job_id].admission.capacity() == 0


def test_a_busy_job_sends_the_worker_to_the_other_at_once(swarm) -> None:
    trainer, worker, a, b = swarm
    records = [trainer.verified_record(a), trainer.verified_record(b)]   # both announce capacity 2
    assert [r.record.demand.capacity for r in records] == [2, 2]
    _fill(trainer, a)                          # A's record is now stale: it announced what it no longer has
    worker.market.current = a                  # the worker was serving A, and keeps it while it wants work
    stop = Stop()
    assert worker.work(records, stop)
    assert stop.waits == []                    # no wait between A's refusal and B's round
    assert worker.sessions[a].stats.leases_refused == {"busy": 1}
    assert worker.sessions[b].stats.groups_admitted == 2
    assert trainer.trainer.jobs[b].ledger.count_pending(b) == 2
    assert worker.market.current == b

    # the same stale records again: A is skipped for a while, not asked again; B wants no more
    # work now (its window is full: 2 pending), so the worker waits
    records = [trainer.verified_record(b), records[0]]
    assert records[0].record.demand.capacity == 0
    assert worker.work(records, stop)
    assert worker.sessions[a].stats.leases_refused == {"busy": 1} and stop.waits == [30]

    # past the skip, A is asked again; a second broken promise doubles the skip
    worker.market.clock.t += 1.01
    assert worker.work([records[1]], stop)
    assert worker.sessions[a].stats.leases_refused == {"busy": 2}
    assert worker.market.skipped(records[1])
    worker.market.clock.t += 1.5
    assert worker.market.skipped(records[1])   # 2 s this time
    worker.market.clock.t += 0.6
    assert not worker.market.skipped(records[1])


def test_records_with_bad_demand_are_ignored_with_a_reason(swarm, caplog) -> None:
    trainer, worker, a, b = swarm
    missing = trainer.record(a)
    missing.ClearField("demand")
    absurd = trainer.record(b)
    absurd.demand.capacity = 10_000
    records = [VerifiedRecord(r, trainer.identity.peer_id, trainer.identity.public_key) for r in (missing, absurd)]
    stop = Stop()
    with caplog.at_level(logging.WARNING, logger="swarmrl.node.worker.market"):
        assert worker.work(records, stop)
        assert worker.work(records, stop)      # logged once per job, not at every look
    assert worker.sessions == {} and stop.waits == [30, 30]
    assert "no demand" in worker.market.ignored[a]
    assert "above the lease book's bound 2" in worker.market.ignored[b]
    assert len([r for r in caplog.records if "ignoring job" in r.getMessage()]) == 2
    assert worker.report()["ignored_jobs"] == worker.market.ignored


def test_busy_skips_back_off_to_a_cap_and_a_granted_lease_resets_them() -> None:
    from swarmrl.node.worker.market import JobMarket
    from swarmrl.protocol.market import BUSY_SKIP_MAX_S

    clock = Clock()
    market = JobMarket(clock=clock)
    rec = VerifiedRecord(pb.JobRecord(job_id="j", demand=pb.Demand(capacity=4, weight=1.0)), "t1", b"k" * 32)
    other = VerifiedRecord(pb.JobRecord(job_id="j", demand=pb.Demand(capacity=4, weight=1.0)), "t2", b"l" * 32)
    skips = [market.refused_busy(rec) for _ in range(8)]
    assert skips[:4] == [1.0, 2.0, 4.0, 8.0] and skips[-1] == BUSY_SKIP_MAX_S
    assert market.skipped(rec) and not market.skipped(other)   # per (job, trainer)
    assert market.pick({"j": rec}) is None and market.pick({"j": other}) == "j"
    market.granted(rec)
    assert market.refused_busy(rec, retry_after_ms=5000) == 5.0   # reset; a longer retry hint is honoured
    clock.t += 5.01
    assert not market.skipped(rec)


def test_a_trainer_that_stepped_is_asked_again_after_the_base_skip() -> None:
    """A busy trainer that then announces a newer head version (it stepped: fresh capacity) ends
    its skip early, never before the base skip; re-announcing the same head does not."""
    from swarmrl.node.worker.market import JobMarket

    clock = Clock()
    market = JobMarket(clock=clock)

    def rec(head: int) -> VerifiedRecord:
        return VerifiedRecord(pb.JobRecord(job_id="j", head_version=head, demand=pb.Demand(capacity=4, weight=1.0)),
                              "t1", b"k" * 32)
    for _ in range(4):
        market.refused_busy(rec(3))                  # the fourth in a row: skipped for 8 s
    clock.t += 0.5
    assert market.skipped(rec(4))                    # stepped, but within the base second
    clock.t += 0.6
    assert market.skipped(rec(3)) and not market.skipped(rec(4))


def test_the_prefetch_follows_only_jobs_chosen_lately(swarm) -> None:
    """A job no round chose within follow_idle_s is not prefetched (it catches up when chosen
    again); a job chosen lately is brought to its announced head."""
    import time

    from swarmrl.node.worker.session import prefetch_followed

    trainer, worker, a, b = swarm
    sessions = {j: worker.session(trainer.verified_record(j)) for j in (a, b)}
    now = time.monotonic()
    sessions[a].chosen_s = now - 61.0   # tried a minute ago, not since
    assert prefetch_followed(sessions, {a: 0, b: 0}, 60.0, now) == [b]
    assert (sessions[a].replica.version, sessions[b].replica.version) == (-1, 0)
    assert prefetch_followed(sessions, {a: 0, b: 0}, 0.0, now) == [a]   # 0: every session is followed
    assert sessions[a].replica.version == 0
