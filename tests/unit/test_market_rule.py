"""The pure job-choice rule (`protocol.market.choose_job`): weighted power-of-two choices.

Draws are counted over many independent choices with a seeded generator; tolerances are a few
standard deviations of the binomial counts (sd of a share p over n draws: sqrt(p(1-p)/n))."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarmrl.protocol.market import Offer, choose_job, fair_split, jain

N = 40_000   # draws per distribution: a share's sd is at most 0.0025


def _shares(offers: list[Offer], n: int = N, seed: int = 1, **kw: object) -> dict[str, float]:
    rng = random.Random(seed)
    got = Counter(choose_job(offers, rng, **kw) for _ in range(n))   # type: ignore[arg-type]
    return {j: c / n for j, c in got.items()}


def test_equally_served_jobs_are_chosen_in_proportion_to_weight() -> None:
    offers = [Offer("a", 8, 30.0, 1.0), Offer("b", 8, 60.0, 2.0), Offer("c", 8, 150.0, 5.0)]   # 30 per weight each
    shares = _shares(offers)
    for o, want in zip(offers, (1 / 8, 2 / 8, 5 / 8)):
        assert shares[o.job_id] == pytest.approx(want, abs=0.01)


def test_nothing_known_yet_is_proportional_to_weight_too() -> None:
    offers = [Offer("a", 4, 0.0, 1.0), Offer("b", 4, 0.0, 3.0)]
    shares = _shares(offers)
    assert shares["a"] == pytest.approx(0.25, abs=0.01) and shares["b"] == pytest.approx(0.75, abs=0.01)


def test_the_second_draw_leans_to_the_under_served_job() -> None:
    # equal weights, "a" served half as well: a wins every mixed pair, so P(a) = 1 - 0.5**2
    shares = _shares([Offer("a", 8, 10.0, 1.0), Offer("b", 8, 20.0, 1.0)])
    assert shares["a"] == pytest.approx(0.75, abs=0.01)


def test_a_job_without_capacity_is_never_chosen_and_none_when_nobody_wants_work() -> None:
    shares = _shares([Offer("full", 0, 0.0, 50.0), Offer("open", 1, 500.0, 1.0)], n=2000)
    assert shares == {"open": 1.0}
    assert choose_job([Offer("full", 0, 0.0, 1.0)], random.Random(0)) is None
    assert choose_job([], random.Random(0)) is None


@pytest.mark.parametrize("seed", range(3))
def test_no_job_with_demand_starves(seed: int) -> None:
    """A light job among heavy, well-served ones: chosen at least at its weight share squared
    (both draws), and as a newcomer (intake 0) at 1 - (1 - p)**2; a worker keeping a heavy job
    moves to it whenever it draws it as the challenger."""
    heavy = [Offer(f"h{i}", 64, 6000.0, 10.0) for i in range(4)]
    light = Offer("light", 2, 0.5, 1.0)
    p = 1.0 / 41
    shares = _shares([*heavy, light], n=20_000, seed=seed)
    assert shares.get("light", 0.0) > p * p / 2
    newcomer = Offer("light", 2, 0.0, 1.0)
    shares = _shares([*heavy, newcomer], n=20_000, seed=seed)
    assert shares.get("light", 0.0) == pytest.approx(1 - (1 - p) ** 2, rel=0.2)
    moved = _shares([*heavy, newcomer], n=20_000, seed=seed, current="h0")
    assert moved.get("light", 0.0) == pytest.approx(p, rel=0.25)


def test_weights_above_the_cap_count_as_the_cap() -> None:
    offers = [Offer("greedy", 8, 0.0, 50.0), Offer("plain", 8, 0.0, 1.0)]
    shares = _shares(offers, cap=1.0)
    assert shares["greedy"] == pytest.approx(0.5, abs=0.01)
    uncapped = _shares(offers)
    assert uncapped["greedy"] == pytest.approx(50 / 51, abs=0.01)


def test_a_kept_job_is_left_only_for_a_clearly_less_served_one() -> None:
    rng = random.Random(3)
    close = [Offer("mine", 8, 100.0, 1.0), Offer("other", 8, 85.0, 1.0)]        # within the 20% margin
    assert {choose_job(close, rng, current="mine") for _ in range(500)} == {"mine"}
    far = [Offer("mine", 8, 100.0, 1.0), Offer("other", 8, 50.0, 1.0)]
    shares = _shares(far, current="mine")
    assert shares["other"] == pytest.approx(0.25, abs=0.01)    # drawn 1/2, then moves with p = 1 - 50/100
    stale = [Offer("mine", 0, 100.0, 1.0), Offer("other", 8, 500.0, 1.0)]
    assert {choose_job(stale, rng, current="mine") for _ in range(200)} == {"mine"}   # its trainer's answer decides
    assert choose_job([Offer("mine", 0, 100.0, 1.0)], rng, current="mine") == "mine"


def test_moves_in_one_pass_are_about_the_excess() -> None:
    """Every worker of an over-served job reads the same records: the expected number that move
    is the excess over the fair split, not all of them (no herd)."""
    offers = [Offer("a", 10_000, 750.0, 1.0), Offer("b", 10_000, 250.0, 1.0)]   # 750 vs 250 workers
    moved = sum(choose_job(offers, random.Random(s), current="a") == "b" for s in range(750))
    assert moved == pytest.approx(250, abs=50)                 # 750 * 1/2 * (1 - 250/750)


def test_weighted_fair_shares_emerge_when_demand_exceeds_supply() -> None:
    """A toy market: 1,000 workers, three saturated jobs of weights 1, 2, 5 (each could use every
    worker); each round every worker re-applies the rule with its job kept, the jobs' intake
    being the workers they got last round. Shares converge to the weights within the margin."""
    rng = random.Random(7)
    weights = {"a": 1.0, "b": 2.0, "c": 5.0}
    on = [None] * 1000
    counts: Counter[str | None] = Counter()
    for _ in range(60):
        offers = [Offer(j, 10_000, float(counts[j]), w) for j, w in weights.items()]
        on = [choose_job(offers, rng, current=cur) for cur in on]
        counts = Counter(on)
    total = sum(weights.values())
    for j, w in weights.items():
        assert counts[j] / 1000 == pytest.approx(w / total, rel=0.25)


def test_a_margin_outside_0_1_and_a_weight_of_0_are_refused() -> None:
    with pytest.raises(ValueError, match="margin"):
        choose_job([Offer("a", 1, 0.0, 1.0)], random.Random(0), margin=1.0)
    with pytest.raises(ValueError, match="weight"):
        choose_job([Offer("a", 1, 0.0, 0.0)], random.Random(0))


def test_fair_split_shares_by_weight_and_gives_a_small_demand_what_it_needs() -> None:
    """Water-filling: 90 units among demands 10, 100, 100 with weights 1, 1, 2. By weight alone
    the first would get 22.5; it needs 10, so the other 80 go 1:2 to the others."""
    share = fair_split(90.0, {"a": 10.0, "b": 100.0, "c": 100.0}, {"a": 1.0, "b": 1.0, "c": 2.0})
    assert share == pytest.approx({"a": 10.0, "b": 80 / 3, "c": 160 / 3})
    assert sum(share.values()) == pytest.approx(90.0)
    assert fair_split(1000.0, {"a": 10.0, "b": 20.0}, {"a": 1.0, "b": 5.0}) == {"a": 10.0, "b": 20.0}   # all satisfied


def test_jain_is_one_when_equal_and_one_over_n_when_one_takes_all() -> None:
    assert jain([2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([]) == 0.0
