"""The simulator's use of the market rules (issue 24 item 7): the trainer's promise from
`protocol.demand.open_capacity`, the rule before it behind `job.lease_rule = "pending"`, busy
workers sent to another trainer at once, and only as many waiters woken as there is capacity."""

from __future__ import annotations

import math

import pytest

from swarmrl.protocol.demand import open_capacity, window_groups
from swarmrl.simulations.cheaters import HONEST
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.network import MBIT, Uplink
from swarmrl.simulations.population import Worker
from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import JobShape, Scenario, load_scenario
from swarmrl.simulations.trainer import SimTrainer
from swarmrl.simulations.worker import HEAD_WAIT_MAX_S, _await_head, _busy, busy_skip_s, skip_ends_s
from swarmrl.simulations.world import World

JOB = JobShape(batch_groups=8, prompts_per_lease=4, max_async_level=2)   # window: 3 x 8 = 24 prompts


def worker(idx: int) -> Worker:
    return Worker(idx=idx, peer_id=f"p{idx}", gpu="rtx4090", tokens_per_s=2000.0, region="na",
                  down_bps=1000 * MBIT, uplink=Uplink("na", 20 * MBIT), nat=False, mode=HONEST,
                  joined_s=0.0, leaves_s=math.inf)


def trainer(job: JobShape = JOB) -> SimTrainer:
    return SimTrainer(0, 1, job, Uplink("na", 1e9), Metrics(), 0.0)


def test_the_trainer_leases_no_more_than_its_open_capacity():
    """6 whole leases fill the window of 24 prompts; a 7th is refused as busy. An answered lease
    turns open prompts into pending groups: the promise stays spent until a step takes a batch."""
    t = trainer()
    assert window_groups(t.spec) == 24
    got = [t.request_lease(worker(i), 0.0, 0, False) for i in range(7)]
    assert [s for s, _ in got] == ["lease"] * 6 + ["busy"]
    assert t.book.open_prompts() == 24 and t.capacity() == 0
    lease = got[0][1]
    assert lease is not None
    assert len(t.submit(worker(0), lease, 5.0, 0)) == 4
    assert len(t.pending) == 4 and t.book.open_prompts() == 20 and t.capacity() == 0
    assert len(t.take_batch(6.0, 0)) == 0   # 4 pending: no full batch yet
    for _, other in got[1:2]:
        assert other is not None and len(t.submit(worker(1), other, 6.0, 0)) == 4
    assert len(t.take_batch(7.0, 0)) == 8
    # the step in progress still counts against the promise (the product's ledger marks its
    # groups trained only once the version is published), so nothing frees until then
    assert t.training == 8 and t.capacity() == 0
    t.published()
    assert t.capacity() == open_capacity(t.spec, len(t.pending), t.book.open_prompts()) == 8
    assert t.m.counts["busy_refusals"] == 1


def test_a_lease_gets_what_is_left_of_the_promise():
    """With 2 prompts of capacity left a lease names 2 prompts, not prompts_per_lease."""
    t = trainer(JobShape(batch_groups=6, prompts_per_lease=4, max_async_level=0))   # window 6
    first = t.request_lease(worker(0), 0.0, 0, False)[1]
    second = t.request_lease(worker(1), 0.0, 0, False)[1]
    assert first is not None and second is not None
    assert (len(first.prompt_indices), len(second.prompt_indices)) == (4, 2)
    assert t.request_lease(worker(2), 0.0, 0, False)[0] == "busy"


def test_the_rule_before_leases_without_limit_until_pending_groups_fill_the_backlog():
    """lease_rule "pending" (the A/B's old rule): open leases don't count, whole leases only."""
    t = trainer(JobShape(batch_groups=8, prompts_per_lease=4, lease_rule="pending"))
    assert all(t.request_lease(worker(i), 0.0, 0, False)[0] == "lease" for i in range(50))
    assert t.book.open_prompts() == 200 and t.capacity() == 4


def test_a_job_beyond_the_products_bounds_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="beyond the product's bounds.*group_size"):
        JobShape(group_size=300)
    with pytest.raises(ValueError, match="lease_rule"):
        JobShape(lease_rule="open")   # type: ignore[arg-type]


def small(**job: object) -> Scenario:
    return load_scenario(None, {"workers": 40, "hours": 0.05, "trainers": {"count": 2}, "validation": {"validators": 0},
                                "job": {"batch_groups": 16, "prompts_per_lease": 4, **job}})


def test_a_busy_worker_skips_the_trainer_and_goes_to_another_with_capacity_at_once():
    world = World(small())
    full, other = world.trainers
    while full.capacity():
        full.request_lease(worker(999), 0.0, 0, False)
    w = world.workers[0]
    w.trainer = full.rank
    with pytest.raises(StopIteration):   # no event: it does not wait
        next(_busy(world, w, full))
    assert w.trainer == other.rank
    assert w.refusals == {full.rank: 1} and w.skips[full.rank] == (1.0, 1.0, 0)


def test_a_busy_skip_ends_early_once_the_trainer_steps_but_not_before_the_base_second():
    w = worker(0)
    w.skips[0] = (8.0, 1.0, 3)   # the 4th refusal in a row at t = 0 s, head version 3
    assert skip_ends_s(w, 0, 3) == 8.0   # no step since: the whole skip
    assert skip_ends_s(w, 0, 4) == 1.0   # it stepped: the base second only
    assert skip_ends_s(w, 1, 4) == 0.0   # a trainer never refused: not skipped


def test_busy_skips_double_per_refusal_in_a_row_up_to_a_minute():
    assert [busy_skip_s(k) for k in (1, 2, 3, 6, 7, 20)] == [1.0, 2.0, 4.0, 32.0, 60.0, 60.0]


def test_a_worker_refused_everywhere_waits_for_capacity_and_every_waiter_wakes_when_it_comes():
    """Both trainers full: the busy worker waits on one it does not skip (after the first
    refusal's 1 s skip, here on the other trainer); nothing wakes it while capacity is 0; when a
    step frees capacity every waiter of that trainer wakes. (The swarm's own workers start later.)"""
    world = World(load_scenario(None, {**small().model_dump(), "job_start_s": 100.0}))
    for t in world.trainers:
        while t.capacity():
            t.request_lease(worker(999), 0.0, 0, False)
    w = world.workers[0]
    w.trainer = 0
    world.env.process(_busy(world, w, world.trainers[0]))
    world.env.run(until=0.5)
    assert [len(q) for q in world.queued] == [0, 1]
    waiters = [world.wait_for_capacity(1) for _ in range(3)]
    world._wake_waiters()
    assert not any(ev.triggered for ev in waiters)
    t = world.trainers[1]
    t.book.revoke(t.book.open_of("p999")[:1])   # one lease's prompts back: capacity 4
    world._wake_waiters()
    assert all(ev.triggered for ev in waiters) and world.queued[1] == []


def test_the_promise_holds_through_a_run_and_wastes_less_than_the_rule_before():
    """40 workers, 2 trainers, 3 simulated minutes: at every 10 s the pending groups plus open
    prompts stay within each trainer's window; the capacity rule wastes a smaller share of what it
    generates than the pending rule on the same scenario."""
    sc = small()
    world = World(sc)

    def check(_now: float) -> None:
        for t in world.trainers:
            assert len(t.pending) + t.book.open_prompts() <= window_groups(t.spec)

    world.run(sc.seconds, lambda: False, slice_s=10.0, progress=check)
    assert world.version > 0
    new = simulate(sc, None)
    old = simulate(small(lease_rule="pending"), None)
    assert new["groups_trained"] > 0 and old["groups_trained"] > 0
    assert new["wasted_share_total"] < old["wasted_share_total"]


def test_ask_at_head_waits_until_the_worker_holds_the_head_and_no_longer_than_its_bound():
    """What-if job.ask_at_head: a worker holding the head asks at once; one that never gets it
    (no version record for it) asks anyway after HEAD_WAIT_MAX_S."""
    world = World(load_scenario(None, {**small(ask_at_head=True).model_dump(), "job_start_s": 100.0}))
    w = world.workers[0]
    world.gossip.held[0][w.idx] = 0.0
    with pytest.raises(StopIteration):   # it holds version 0, the head: no wait
        next(_await_head(world, w))
    world.version = 5
    world.gossip.held[5] = {}   # published, w not among the holders
    proc = world.env.process(_await_head(world, w))
    world.env.run(until=proc)
    assert world.env.now == HEAD_WAIT_MAX_S
    world.gossip.held[5] = {w.idx: 40.0}   # it will hold it 10 s from now
    proc = world.env.process(_await_head(world, w))
    world.env.run(until=proc)
    assert world.env.now == 40.0


def answered(t: SimTrainer, groups: int, first: int) -> None:
    """`groups` prompts leased at version 0 and answered at once by honest workers `first`, ..."""
    for i in range(groups // t.job.prompts_per_lease):
        status, lease = t.request_lease(worker(first + i), 0.0, 0, False)
        assert status == "lease" and lease is not None
        t.submit(worker(first + i), lease, 0.0, 0)


@pytest.mark.parametrize("join", [True, False])
def test_a_trainer_short_of_a_batch_joins_its_cotrainers_round_with_what_it_has(join: bool):
    """Two trainers, batch 16: one has a full trainable batch, the other 8 groups. The product's
    trainer joins a cotrainer's open round at once with what it has (TrainerNode.step: ready()
    or peer_round_open()), so the step trains 24 groups and nothing is left to age; under the
    rule before (`trainers.join_rounds = false`) the round waits averaging_timeout_s for it, then
    goes without it, and its 8 groups are a version older at the next step."""
    base = small().model_dump()
    sc = load_scenario(None, {**base, "job_start_s": 1000.0, "validation": {"validators": 0, "probation_s": 0},
                              "trainers": {**base["trainers"], "join_rounds": join}})
    world = World(sc)
    full, short = world.trainers
    answered(full, 16, 0)
    answered(short, 8, 100)
    world.env.run(until=60.0)
    first_step_s, version, trained = world.metrics.steps[0]
    assert version == 1
    if join:
        assert trained == 24 and len(short.pending) == 0 and first_step_s < sc.trainers.averaging_timeout_s
    else:
        assert trained == 16 and len(short.pending) == 8 and first_step_s >= sc.trainers.averaging_timeout_s
    assert [n for _, _, n in world.metrics.steps[1:]] == []   # no more groups: no more steps
