"""Many jobs in the simulator (issue 24 item 7, `simulations/market_world.py`): the jobs share the
workers by the product's rule, every job with demand trains, the heavier job gets more when
supply is short, the rule before walks the jobs in turn, a worker coming back to a job catches up
by deltas, and a bad market scenario is one line naming the field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from swarmrl.simulations.cheaters import HONEST
from swarmrl.simulations.gossip import DeltaSpread
from swarmrl.simulations.market_world import MarketWorld
from swarmrl.simulations.network import MBIT, Uplink
from swarmrl.simulations.population import Worker
from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import Gossip, Scenario, _merge, load_scenario, scenario_error


def market(over: dict[str, Any] | None = None) -> Scenario:
    """40 workers, 3 jobs on the GPU profile (two of weight 1, one of weight 4), 3 simulated minutes."""
    base = {"name": "market-test", "hours": 0.05, "workers": 40, "seed": 0,
            "market": {"jobs": [{"count": 2, "weight": 1, "batch_groups": 16},
                                {"count": 1, "weight": 4, "batch_groups": 16}]}}
    return load_scenario(None, _merge(base, over or {}))


def test_a_market_trains_every_job_and_its_figures_add_up():
    s = simulate(market(), None)
    assert s["jobs"] == 3 and s["trainers"] == 3 and not s["interrupted"]
    rows = s["per_job"]
    assert all(r["versions"] > 0 for r in rows) and s["fairness"]["jobs_starved"] == 0
    assert s["groups_generated"] == sum(r["groups_generated"] for r in rows)
    assert s["groups_trained"] == pytest.approx(sum(r["groups_trained_per_hour"] for r in rows) * 0.05, abs=3)
    assert 0 <= s["wasted_share_total"] <= 1 and s["honest_banned"] == 0
    assert s["workers"]["served_more_than_one_job"] > 0   # workers move between jobs
    assert simulate(market(), None)["per_job"] == rows    # a run is a pure function of its scenario


def test_when_supply_is_short_the_heavier_job_trains_more():
    """8 workers on the slowest class cannot fill three jobs of 64 groups a step: the job of
    weight 4 trains more than either job of weight 1 (the rule leans to the under-served per
    unit of weight)."""
    s = simulate(market({"workers": 8, "hours": 0.1, "gpu_mix": {"rtx3060": 1.0},
                         "market": {"jobs": [{"count": 2, "weight": 1, "batch_groups": 64},
                                             {"count": 1, "weight": 4, "batch_groups": 64}]}}), None)
    light, heavy = s["per_job"][:2], s["per_job"][2]
    assert all(heavy["groups_trained_per_hour"] > r["groups_trained_per_hour"] for r in light), s["per_job"]


def test_the_rule_before_walks_every_job_in_turn():
    s = simulate(market({"market": {"choice": "walk"}}), None)
    assert s["market_choice"] == "walk"
    assert s["workers"]["served_more_than_one_job"] > 0.9   # one lease each, in turn
    assert s["fairness"]["jobs_starved"] == 0


def test_followers_idle_longer_than_follow_idle_s_stop_following():
    mw = MarketWorld(market({"market": {"follow_idle_s": 20.0}}))
    mw.run(mw.sc.seconds, lambda: False)
    for job in mw.jobs:
        last_step = job.metrics.steps[-1][0]
        assert all(t >= last_step - 20.0 for t in job.last_chosen.values())
        assert set(job.live) == set(job.last_chosen)


def test_a_ban_holds_at_the_job_whose_check_failed_and_the_worker_serves_the_others():
    """As the product's trainers act on their own job's verdicts (`Admission.apply_verdicts`), a
    validator's failed check bans the peer at that job only; the worker, refused there as banned,
    chooses among the others and leaves the market once every job has banned it."""
    mw = MarketWorld(market())
    mw.run(60.0, lambda: False)   # the records are announced
    w, (first, *others) = mw.spawn(), mw.jobs
    mw.ban(w, "validator:regrade", first.job_id)
    assert all(w.peer_id in t.banned for t in first.trainers)
    assert not any(w.peer_id in t.banned for job in others for t in job.trainers)
    assert math.isfinite(w.banned_s) and mw.metrics.bans[w.peer_id] == "validator:regrade"
    assert not mw.banned_everywhere(w, first)
    assert {getattr(mw.choose(w, None, None), "job_id", None) for _ in range(50)} <= {j.job_id for j in others}
    assert not mw.banned_everywhere(w, others[0]) and mw.banned_everywhere(w, others[1])


def test_a_cheater_banned_at_one_job_goes_on_to_the_others_until_their_own_checks_ban_it():
    mw = MarketWorld(market({"hours": 0.1, "cheaters": {"share": 0.25, "modes": ["inflated_reward"]}}))
    bans: dict[str, dict[str, float]] = {}      # peer -> job -> when banned there
    submitted: list[tuple[float, str, str]] = []   # (when, peer, job) of every admitted batch reviewed
    ban, review = mw.validators.ban, mw.validators.review
    mw.validators.ban = lambda w, why, job_id: (bans.setdefault(w.peer_id, {}).setdefault(job_id, mw.env.now),
                                                ban(w, why, job_id))[-1]
    mw.validators.review = lambda w, ix, v, now, job_id="": (submitted.append((now, w.peer_id, job_id)),  # type: ignore[method-assign]
                                                            review(w, ix, v, now, job_id))[-1]
    mw.run(mw.sc.seconds, lambda: False)
    assert not any(math.isfinite(w.banned_s) for w in mw.workers if not w.cheater)
    first = {peer: min(at.items(), key=lambda kv: kv[1]) for peer, at in bans.items()}   # peer -> (job, when)
    went_on = {peer for when, peer, job in submitted if peer in first and job != first[peer][0] and when > first[peer][1]}
    assert went_on, bans   # served another job after its first ban
    assert all(len(bans[peer]) > 1 for peer in went_on), bans   # and was banned there by that job's checks


def _worker(idx: int) -> Worker:
    return Worker(idx=idx, peer_id=f"p{idx}", gpu="rtx4090", tokens_per_s=2000.0, region="na",
                  down_bps=1000 * MBIT, uplink=Uplink("na", 20 * MBIT), nat=True, mode=HONEST,
                  joined_s=0.0, leaves_s=math.inf)


def test_following_on_grant_keeps_a_job_followed_only_while_it_grants_this_worker_leases():
    mw = MarketWorld(market({"market": {"follow_on": "grant", "follow_idle_s": 20.0}}))
    job, w = mw.jobs[0], _worker(999)
    job.follow(w)   # chosen: it catches up first, then asks
    job.leased(w, granted=False)
    assert w.idx not in job.live   # refused and never granted: it stops following at once
    job.follow(w)
    job.leased(w, granted=True)
    mw.run(10.0, lambda: False)
    job.leased(w, granted=False)
    assert w.idx in job.live       # refused, but granted 10 s ago: still followed
    mw.run(35.0, lambda: False)
    job.leased(w, granted=False)
    assert w.idx not in job.live   # no grant within follow_idle_s


def test_a_worker_coming_back_catches_up_by_deltas_within_max_gap_else_by_a_snapshot():
    trainer = Uplink("na", 1000 * MBIT)
    spread = DeltaSpread(Gossip(max_gap=3), delta_bytes=1000, snapshot_bytes=10_000, announce_s=0.0, seed="t",
                         trainer_source=lambda w, at: (trainer, math.inf))
    w = _worker(0)
    assert math.isfinite(spread.catch_up(w, 0.0))   # nothing held: a snapshot
    assert spread.trainer_bytes == 10_000
    for v in (1, 2):   # published while it served another job: it did not follow
        spread.publish(v, 10.0 * v, [])
    assert math.isfinite(spread.catch_up(w, 25.0))   # 2 behind: 2 deltas
    assert spread.trainer_bytes == 12_000 and spread.held_at(w, 2) < math.inf
    for v in range(3, 7):
        spread.publish(v, 10.0 * v, [])
    assert math.isfinite(spread.catch_up(w, 65.0))   # 4 behind, max_gap 3: a snapshot
    assert spread.trainer_bytes == 22_000


@pytest.mark.parametrize(("over", "needle"), [
    ({"trainers": {"lost_at_s": 10.0, "count": 2}}, "trainers.lost_at_s"),
    ({"workers": 2}, "market.jobs: 3 trainers for 2 workers"),
    ({"market": {"jobs": [{"weight": 1000}]}}, "market.jobs.0.weight"),
    ({"market": {"jobs": [{"batch_groups": 10**6}]}}, "market.jobs: job 0 is beyond the product's bounds"),
    ({"market": {"choice": "random"}}, "market.choice"),
])
def test_a_bad_market_scenario_is_one_line_naming_the_field(over, needle):
    with pytest.raises(ValueError) as err:
        market(over)
    line = scenario_error(err.value) if isinstance(err.value, ValidationError) else str(err.value)
    assert needle in line and "\n" not in line


def test_elastic_intake_steps_on_larger_batches_when_supply_allows():
    """A job declaring 16..64 groups a step (`batch_max`, the product's elastic intake) steps on
    more than 16 when more is trainable, and its demand counts the largest batch."""
    mw = MarketWorld(market({"market": {"jobs": [{"count": 1, "batch_groups": 16, "batch_max": 64}]}}))
    mw.run(mw.sc.seconds, lambda: False)
    trained = [n for _, _, n in mw.jobs[0].metrics.steps]
    assert trained and min(trained) >= 16 and max(trained) > 16 and max(trained) <= 64
    assert mw.jobs[0].step_s(1, 64) > mw.jobs[0].step_s(1, 16)   # a larger batch takes longer
