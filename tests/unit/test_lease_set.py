"""A round's lease set (`protocol.lease_set.plan_round`, issue 24 item 2's vLLM part): up to k
jobs, each kept job challenged once, free places filled by the one-job rule; k = 1 is the
one-job rule draw for draw. And the worker's side (`JobMarket.plan`, `keep`, `refused_busy`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.worker.market import JobMarket
from swarmrl.protocol.lease_set import plan_round
from swarmrl.protocol.market import Offer, choose_job
from swarmrl.protocol.pb import swarm_pb2 as pb


def offers(*specs: tuple[str, int, float, float]) -> list[Offer]:
    return [Offer(j, cap, intake, w) for j, cap, intake, w in specs]


def test_one_job_a_round_is_the_one_job_rule_draw_for_draw() -> None:
    gen = random.Random(7)
    for trial in range(300):
        jobs = [Offer(f"j{i}", gen.choice([0, 2, 5]), gen.choice([0.0, 3.0, 10.0]), gen.choice([1.0, 2.0, 4.0]))
                for i in range(gen.randint(1, 5))]
        current = gen.choice([None, "j0", "j3", "gone"])
        want = choose_job(jobs, random.Random(trial), current=current)
        got = plan_round(jobs, random.Random(trial), kept=[] if current is None else [current], k=1)
        assert got == ([] if want is None else [want]), (trial, jobs, current)


def test_kept_jobs_served_alike_all_stay_in_order() -> None:
    jobs = offers(("a", 4, 10.0, 1.0), ("b", 4, 10.0, 1.0), ("c", 4, 10.0, 1.0))
    for seed in range(200):
        assert plan_round(jobs, random.Random(seed), kept=["b", "a"], k=2) == ["b", "a"]


def test_a_set_is_distinct_jobs_that_want_work_at_most_k() -> None:
    jobs = offers(("a", 4, 1.0, 1.0), ("b", 0, 1.0, 1.0), ("c", 2, 5.0, 2.0), ("d", 1, 0.0, 1.0))
    sizes = Counter()
    for seed in range(500):
        plan = plan_round(jobs, random.Random(seed), k=3)
        assert len(plan) == len(set(plan)) == 3 and "b" not in plan   # b announces no capacity
        sizes[len(plan)] += 1
    assert plan_round(jobs, random.Random(0), k=8) and len(plan_round(jobs, random.Random(0), k=8)) == 3
    # a kept job stays whatever capacity its record announced (its trainer's answer decides)
    assert "b" in plan_round(jobs, random.Random(0), kept=["b"], k=1) + plan_round(jobs, random.Random(1), kept=["b"], k=1)
    assert plan_round(offers(("a", 0, 1.0, 1.0)), random.Random(0), k=2) == []
    assert plan_round(offers(("a", 0, 1.0, 1.0)), random.Random(0), kept=["a", "gone"], k=2) == ["a"]


def test_a_kept_job_challenged_away_is_out_of_the_round() -> None:
    """Kept a and b are served far better than c (nobody serves it): c takes one place at times,
    and then the other kept job keeps the other place; the job it displaced is not challenged
    again in its stead, so [c, a] never happens, while [c, b] and [a, c] do."""
    jobs = offers(("a", 4, 100.0, 1.0), ("b", 4, 100.0, 1.0), ("c", 4, 0.0, 1.0))
    seen = Counter(tuple(plan_round(jobs, random.Random(s), kept=["a", "b"], k=2)) for s in range(3000))
    assert seen[("c", "a")] == 0 and seen[("c", "b")] > 0 and seen[("a", "c")] > 0 and seen[("a", "b")] > 0
    assert set(seen) <= {("a", "b"), ("c", "b"), ("a", "c")}
    # the move rule's odds, one challenge per kept job: c is drawn as a place's challenger with
    # probability 1/3 and then always wins (its service is 0), so a keeps its place 2/3 of the time
    kept_a = (seen[("a", "b")] + seen[("a", "c")]) / 3000
    assert abs(kept_a - 2 / 3) < 0.04, kept_a


def test_free_places_follow_the_weights() -> None:
    """Nothing known yet (intake 0 everywhere): the first place is a weighted draw, so the heavy
    job leads most sets; the set of two always holds two distinct jobs."""
    jobs = offers(("light", 4, 0.0, 1.0), ("heavy", 4, 0.0, 9.0), ("mid", 4, 0.0, 3.0))
    first = Counter(plan_round(jobs, random.Random(s), k=2)[0] for s in range(4000))
    assert first["heavy"] > first["mid"] > first["light"] > 0


def test_k_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 job"):
        plan_round(offers(("a", 1, 0.0, 1.0)), random.Random(0), k=0)


def _rec(job: str, trainer: str = "t") -> VerifiedRecord:
    return VerifiedRecord(pb.JobRecord(job_id=job, demand=pb.Demand(capacity=4, weight=1.0)), trainer, b"k" * 32)


def test_the_market_keeps_a_rounds_jobs_and_drops_a_busy_one() -> None:
    market = JobMarket(rng=random.Random(0))
    live = {j: _rec(j) for j in ("a", "b", "c")}
    plan = market.plan(live, 2)
    assert len(plan) == 2 and len(set(plan)) == 2
    market.keep(plan)
    assert market.kept == plan and market.current == plan[0]
    for seed in range(50):   # every job served alike (nothing announced): the kept pair stays
        market.rng = random.Random(seed)
        assert market.plan(live, 2) == plan
    market.refused_busy(live[plan[0]])
    assert market.kept == plan[1:]
    assert plan[0] not in market.plan(live, 3)   # its trainer is skipped a while
    assert market.plan(live, 1, keep=False) != [] and market.plan({}, 2) == []
