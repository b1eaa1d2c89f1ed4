"""Which job a worker serves next: weighted power-of-two choices over the jobs' announced demand.

The rule (docs/MARKET.md says why it is fair):
1. Candidates are the jobs that want work: announced capacity > 0 (`protocol.demand`).
2. Each job's weight is capped (`min(weight, cap)`); its "service" is its announced intake per
   unit of weight, `intake_per_min / weight`: how well the swarm serves it relative to its share.
3. A worker with no job it keeps draws two candidates at random with probability proportional to
   weight (with replacement) and takes the one with the lower service; on a tie, either one with
   probability 1/2. So when every job is served alike (or nothing is known yet) a job is chosen
   with probability exactly weight / total weight; otherwise the draw leans to the under-served.
4. A worker keeps its job while the job wants work, which its trainer's live answer tells (a
   lease, or `busy`: then the worker drops it), not the record's capacity, which is as old as
   the record. It draws one challenger among the candidates and its own job (by weight) and,
   if the challenger's service is below `(1 - margin)` times its own job's, moves with
   probability `1 - challenger's / own`. So workers drift from over-served jobs to under-served
   ones in proportion to the gap, without thrashing on noise, and without the herd that a
   sure move makes when every worker reads the same stale records: with two jobs, the workers
   that move in one pass are about the excess (benchmarks/market_rule.py --stale).

Why randomized: 10,000 workers reading the same records would all pick the same "best" job;
independent weighted draws spread them by weight, and the second draw only sharpens that.
Starvation is impossible: a candidate of weight w among total W is drawn first with probability
w / W > 0 at every choice, and a job nobody serves (intake 0) wins every comparison it is drawn
into against a served one. A job that needs little fills its capacity, drops out of the
candidates, and the rest of the supply goes to the others.

Pure (no network, no clock; randomness from the `random.Random` passed in): the worker
(`node/worker/market.py`) and the simulator run the same rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

MAX_WEIGHT = 100.0
"""The protocol's bound on a job's weight (`JobSpec.weight`); a trainer caps it lower by policy."""
SWITCH_MARGIN = 0.2   # a kept job is left only for one served at most 80% as well per unit of weight
BUSY_SKIP_S = 1.0        # the shortest skip of a trainer that broke a promise (its retry hint if longer)
BUSY_SKIP_MAX_S = 60.0   # the longest


FOLLOW_IDLE_S = 60.0   # a worker prefetches a job's versions while it chose the job within this long


def follows(chosen_s: float, now_s: float, idle_s: float = FOLLOW_IDLE_S) -> bool:
    """Whether a worker keeps prefetching the versions of a job it last chose at `chosen_s`
    (seconds, the clock of `now_s`): while it chose it within `idle_s` (0: always). A job not
    chosen for longer catches up when it is chosen again (deltas within max_gap, else a
    snapshot), so a worker that tried many jobs does not download every one's versions. In the
    simulator (10,000 workers, 50 jobs, 0.1 h) following every job tried trained 0.69x the groups
    of following for 60 s (simulations/README.md, "Many jobs")."""
    return idle_s <= 0 or now_s - chosen_s <= idle_s


def busy_skip(retry_after_s: float, refusals: int) -> tuple[float, float]:
    """(skip, base), seconds: how long a worker skips a trainer that announced capacity and then
    refused `refusals` (>= 1) leases in a row as busy, `min(BUSY_SKIP_MAX_S, base * 2 ** (refusals - 1))`
    with `base = max(retry_after_s, BUSY_SKIP_S)`, and the base, before which the skip never ends
    early (`skip_ends`). A granted lease resets `refusals` (the caller counts them)."""
    base = max(retry_after_s, BUSY_SKIP_S)
    return min(BUSY_SKIP_MAX_S, base * 2.0 ** (refusals - 1)), base


def skip_ends(until: float, earliest: float, head_when_refused: int, head_now: int) -> float:
    """When a busy skip ends, on the clock of `until` (skip end) and `earliest` (refusal + base):
    at `until`, or sooner, never before `earliest`, once the trainer announces a newer head version
    than when it refused (it stepped, so its capacity is fresh)."""
    return min(until, earliest) if head_now > head_when_refused else until


@dataclass(frozen=True)
class Offer:
    """One job as a worker sees it in its record: `capacity` prompts it can lease now,
    `intake_per_min` groups it consumed per minute lately, `weight` (> 0)."""

    job_id: str
    capacity: int
    intake_per_min: float
    weight: float


def capped(weight: float, cap: float = MAX_WEIGHT) -> float:
    """The weight the rule uses: `min(weight, cap)`."""
    return min(weight, cap)


def service(offer: Offer, cap: float = MAX_WEIGHT) -> float:
    """Groups per minute per unit of (capped) weight: lower means under-served."""
    return offer.intake_per_min / capped(offer.weight, cap)


def choose_job(offers: Sequence[Offer], rng: random.Random, *, current: str | None = None,
               cap: float = MAX_WEIGHT, margin: float = SWITCH_MARGIN) -> str | None:
    """The job to serve next (see the module docstring), or None when no job wants work and
    there is no current one.

    current: the job the worker serves now, whatever capacity it announced (the caller drops it
        when its trainer refuses as busy); kept unless a challenger is served less than
        `(1 - margin)` times as well, and then left with probability `1 - challenger's service /
        its own`.
    cap: weights above it count as `cap`.
    Raises ValueError for a weight that is not > 0 or a margin outside [0, 1).
    """
    if not 0 <= margin < 1:
        raise ValueError(f"switch margin {margin} is not in [0, 1)")
    if any(not o.weight > 0 for o in offers):
        raise ValueError("every job's weight must be > 0 (protocol.demand.check_demand)")
    kept = next((o for o in offers if o.job_id == current), None)   # whatever it announced: its trainer's answer decides
    wanting = [o for o in offers if o.capacity > 0 or o is kept]
    if not wanting:
        return None
    weights = [capped(o.weight, cap) for o in wanting]
    challenger = rng.choices(wanting, weights)[0]   # the kept job among them: drawn, it stays
    if kept is not None:
        if challenger is kept:
            return kept.job_id
        mine, theirs = service(kept, cap), service(challenger, cap)
        moves = theirs < (1 - margin) * mine and rng.random() < 1 - theirs / mine
        return challenger.job_id if moves else kept.job_id
    first = rng.choices(wanting, weights)[0]
    a, b = service(first, cap), service(challenger, cap)
    if a == b:
        return rng.choice((first, challenger)).job_id
    return (first if a < b else challenger).job_id


def intake_shares(offers: Sequence[Offer]) -> dict[str, float]:
    """Each job's share of the swarm's work: its `intake_per_min` over the total of `offers`
    (groups consumed per minute, so a fraction of what the swarm trains); 0 for all when nothing
    was consumed yet."""
    total = sum(max(0.0, o.intake_per_min) for o in offers)
    return {o.job_id: (max(0.0, o.intake_per_min) / total if total > 0 else 0.0) for o in offers}


def weight_shares(offers: Sequence[Offer], cap: float = MAX_WEIGHT) -> dict[str, float]:
    """Each job's share by (capped) weight among `offers`: what the rule gives it when every job
    wants more than the swarm supplies (docs/MARKET.md, "Fair shares"); a job that needs less
    takes less, and the rest goes to the others.

    Raises ValueError for a weight that is not > 0."""
    if any(not o.weight > 0 for o in offers):
        raise ValueError("every job's weight must be > 0 (protocol.demand.check_demand)")
    total = sum(capped(o.weight, cap) for o in offers)
    return {o.job_id: capped(o.weight, cap) / total for o in offers}


def fair_split(supply: float, demand: dict[str, float], weight: dict[str, float]) -> dict[str, float]:
    """Weighted max-min fair shares of `supply` among jobs with `demand` and `weight` (any one
    unit, e.g. groups per hour): water-filling, as in Bertsekas & Gallager, "Data Networks" (1992)
    §6.5.2. Supply is shared by weight among the jobs still wanting more; a job whose demand is
    below its share gets its demand and the rest is shared again. The split the market rule aims
    at (docs/MARKET.md, "Fair shares"); benchmarks and the simulator measure against it.

    Raises KeyError when a job of `demand` has no weight."""
    share = {j: 0.0 for j in demand}
    wanting, left = sorted(demand), supply
    while wanting and left > 1e-9:
        total = sum(weight[j] for j in wanting)
        offer = {j: left * weight[j] / total for j in wanting}
        done = [j for j in wanting if demand[j] - share[j] <= offer[j]]
        if not done:
            for j in wanting:
                share[j] += offer[j]
            break
        for j in done:
            left -= demand[j] - share[j]
            share[j] = demand[j]
        wanting = [j for j in wanting if j not in done]
    return share


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index `(sum x)^2 / (n sum x^2)` (Jain, Chiu & Hawe, DEC-TR-301, 1984): 1 when
    every x is equal, 1/n when one takes all; 0.0 for no x or all zero."""
    squares = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * squares) if squares else 0.0
