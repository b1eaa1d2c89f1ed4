"""Many jobs sharing one swarm's workers (issue 24 item 7): the jobs' worlds on one clock, the
workers, their choice of job, and what the market measured.

Each job is a `world.World` in a market: its own trainers (the real `LeaseBook` and promise),
step clock and delta gossip, on the market's clock and validators. The market owns the workers
(the population, arrivals) and moves them between jobs by the product's rules:
- the job records' demand (capacity summed over the job's trainers, intake per minute over the
  last `demand.INTAKE_WINDOW_S`, weight) is refreshed every `market.record_every_s`
  (node/swarm/dht.REFRESH_S), and a worker chooses on the last refresh;
- `market.choice = "demand"`, the product's (`node/worker/market.py`): `protocol.market.choose_job`
  over the jobs whose trainers it does not skip, keeping its job while the job's trainer grants
  leases; a `busy` refusal skips that trainer for that job (`protocol.market.busy_skip`,
  `skip_ends`) and the worker chooses again at once;
- `"walk"`, the rule before: every unfinished job in turn, one lease each, whatever it needs;
- a worker follows (receives the versions of) every job it chose within `market.follow_idle_s`
  (`protocol.market.follows`, the product worker's prefetch); choosing a job it does not follow,
  it catches up first, from the version it kept (deltas within `max_gap`, else a snapshot:
  `DeltaSpread.catch_up`), as the product's worker does before asking (`catch_up_to_head`).

Elastic intake runs as the product's (a class's `batch_max`: a step takes what is trainable from
`batch_groups` up to `batch_max`, its time growing with the batch). Not simulated: a worker
batching several jobs in one engine round (`lease_set.plan_round`: its rounds here are one job
each, as on the transformers backend), a trainer's loss.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator
from typing import Any

import simpy

from swarmrl.protocol import admission as adm
from swarmrl.protocol.leases import BUSY_RETRY_MS
from swarmrl.protocol.market import Offer, busy_skip, choose_job, skip_ends
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.population import Population, Worker
from swarmrl.simulations.profiles import MODEL_PROFILES
from swarmrl.simulations.scenario import Scenario
from swarmrl.simulations.validator import Validators
from swarmrl.simulations.worker import JOB_POLL_S, lease_round
from swarmrl.simulations.world import TRAINER_REGIONS, InMarket, World, advance, arrivals, schedule


class MarketWorld:
    """Every job of a market scenario (`sc.market.jobs`) and the workers they share."""

    def __init__(self, sc: Scenario) -> None:
        if not sc.market.jobs:
            raise ValueError("market.jobs: a market scenario needs at least one class of jobs")
        self.sc, self.env = sc, simpy.Environment()
        self.profile = MODEL_PROFILES[sc.job.model]
        self.rng = random.Random(f"market/{sc.seed}")
        self.metrics = Metrics()   # the validators' (verdict delays, bans); the jobs count their own
        self.population = Population(sc, self.profile)
        self.validators = Validators(sc.validation, sc.seed, self.metrics, self.schedule, self.ban, self.passed)
        self.jobs = [World(sc, market=InMarket(self.env, self.validators, j % len(TRAINER_REGIONS)), job=shape,
                           trainers=n, job_id=f"job{j:03d}")
                     for j, (shape, n) in enumerate(sc.market.shapes(sc.job))]
        self.by_id = {job.job_id: job for job in self.jobs}
        self.offers: list[Offer] = []
        self.refreshed = self.env.event()   # fires at the next refresh of the records' demand
        self.workers: list[Worker] = []
        self.live: dict[int, Worker] = {}
        self.served: dict[int, set[str]] = {}   # worker idx -> the jobs it leased from
        self.switches = 0
        self.env.process(self._records())
        for _ in range(sc.workers):
            self.spawn()
        self.env.process(self._arrivals())

    @property
    def done(self) -> bool:
        """True when every job reached its steps."""
        return all(job.done for job in self.jobs)

    # ---- plumbing
    def schedule(self, at_s: float, fn: Callable[[], None]) -> None:
        """Call `fn` at simulated time `at_s` (s; now if that has passed)."""
        schedule(self.env, at_s, fn)

    def spawn(self) -> Worker:
        """A new worker, choosing its job once its session starts."""
        w = self.population.make(self.env.now)
        self.workers.append(w)
        self.env.process(market_life(self, w))
        return w

    def ban(self, w: Worker, why: str, job_id: str) -> None:
        """A validator's failed banning check on a group of `job_id`: that job's trainers ban the
        peer, as the product's do (`Admission.apply_verdicts` is per job); the others keep serving
        it until their own checks catch it. `w.banned_s` is its first ban anywhere."""
        self.metrics.ban_reason(w, why)
        w.banned_s = min(w.banned_s, self.env.now)
        self.by_id[job_id].ban_at_trainers(w)

    def passed(self, w: Worker) -> None:
        """A validator passed `w`: its groups at every trainer leave probation."""
        for job in self.jobs:
            for t in job.trainers:
                t.pending.passed(w)

    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        return arrivals(self.env, self.rng, self.sc.churn.joins_per_hour, self.spawn)

    def _records(self) -> Generator[simpy.Event, Any, None]:
        """Refresh the demand every job's record announces, every `market.record_every_s`."""
        while True:
            now = self.env.now
            self.offers = [Offer(job.job_id, job.capacity(), job.intake.per_minute(now), job.job.weight)
                           for job in self.jobs if not job.done]
            ev, self.refreshed = self.refreshed, self.env.event()
            ev.succeed()
            yield self.env.timeout(self.sc.market.record_every_s)

    # ---- a worker's choice
    def skipped(self, w: Worker, job: World, rank: int) -> bool:
        """Whether `w` skips trainer `rank` of `job` now (it refused a lease as busy lately)."""
        until, earliest, head = w.market_skips.get((job.job_id, rank), (0.0, 0.0, 0))
        return skip_ends(until, earliest, head, job.version) > self.env.now

    def choose(self, w: Worker, kept: World | None, after: World | None) -> World | None:
        """The job `w` serves next (None: none wants work). "demand": `choose_job` over the
        records of the jobs with a trainer `w` does not skip, keeping `kept`; "walk": the next
        unfinished job after `after` in turn."""
        if self.sc.market.choice == "walk":
            live = [job for job in self.jobs if not job.done and job.job_id not in w.market_banned]
            if not live:
                return None
            start = 0 if after is None else self.jobs.index(after) + 1
            return min(live, key=lambda job: (self.jobs.index(job) - start) % len(self.jobs))
        offers = [o for o in self.offers if not self.by_id[o.job_id].done   # a done job's record says so
                  and o.job_id not in w.market_banned
                  and not all(self.skipped(w, self.by_id[o.job_id], t.rank) for t in self.by_id[o.job_id].trainers)]
        pick = choose_job(offers, self.rng, current=kept.job_id if kept is not None else None)
        return None if pick is None else self.by_id[pick]

    def trainer_for(self, w: Worker, job: World) -> int:
        """The trainer of `job` that `w` asks: a live one it does not skip, with capacity if any."""
        alive = [t for t in job.trainers if t.alive and not self.skipped(w, job, t.rank)] or \
            [t for t in job.trainers if t.alive]
        ready = [t for t in alive if t.capacity() > 0] or alive
        return ready[self.rng.randrange(len(ready))].rank

    def banned_everywhere(self, w: Worker, job: World) -> bool:
        """`job`'s trainer refused `w` as banned: it chooses among the other jobs from now on;
        True when every job has banned it (it leaves the market)."""
        w.market_banned.add(job.job_id)
        return len(w.market_banned) == len(self.jobs)

    def refused_busy(self, w: Worker, job: World, rank: int) -> None:
        """`rank` of `job` refused `w` as busy: skip it for that job (`busy_skip`, `skip_ends`)."""
        key = (job.job_id, rank)
        k = w.market_refusals[key] = w.market_refusals.get(key, 0) + 1
        skip, base = busy_skip(BUSY_RETRY_MS / 1000, k)
        w.market_skips[key] = (self.env.now + skip, self.env.now + base, job.version)

    # ---- running
    def run(self, until_s: float, should_stop: Callable[[], bool], slice_s: float = 60.0,
            progress: Callable[[float], None] | None = None) -> float:
        """Advance to `until_s` (or every job's end); returns the simulated time reached."""
        advance(self.env, until_s, lambda: self.done or should_stop(), slice_s, progress)
        return self.env.now


def market_life(mw: MarketWorld, w: Worker) -> Generator[simpy.Event, Any, None]:
    """The process of one worker session in a market: choose a job, catch up on it, lease rounds
    while it grants leases (choosing again after each), another job at once on `busy`."""
    env = mw.env
    yield env.timeout(max(0.0, mw.sc.job_start_s - env.now) + mw.rng.uniform(0, JOB_POLL_S))
    mw.live[w.idx] = w
    job: World | None = None      # the job followed
    kept: World | None = None     # the job whose trainer granted the last lease (kept while it wants work)
    by_grant = mw.sc.market.follow_on == "grant"
    while env.now < w.leaves_s:
        nxt = mw.choose(w, kept, job)
        if nxt is None:   # no job wants work: the records say nothing new before their next refresh
            yield mw.refreshed | env.timeout(max(0.0, w.leaves_s - env.now))
            yield env.timeout(mw.rng.uniform(0, JOB_POLL_S))   # read at the worker's next poll
            continue
        mw.switches += job is not None and nxt is not job
        job = nxt
        if w.idx in job.live:
            if not by_grant:
                job.chosen(w)
        elif math.isinf(job.follow(w)):   # not followed (new, or idle past follow_idle_s): catch up first;
            job.metrics.count("adapter_behind")   # no source served it: the lease round catches up afresh
        rank = mw.trainer_for(w, job)
        status = yield from lease_round(job, w, job.trainers[rank])
        if by_grant and w.idx in job.live:
            job.leased(w, granted=status in ("leased", "behind"))
        if status == "crashed" or (status == adm.BANNED and mw.banned_everywhere(w, job)):
            break
        if status == adm.BANNED:   # this job's trainers ban it: the others may still want its work
            job.unfollow(w)
            kept = None
        elif status == "busy":
            mw.refused_busy(w, job, rank)
            kept = None
            if mw.sc.market.choice == "walk":   # the rule before: the retry hint, then the next job
                yield env.timeout(mw.rng.uniform(0, BUSY_RETRY_MS / 1000))
        elif status == "job_done":
            kept = None
        else:
            w.market_refusals.pop((job.job_id, rank), None)   # a granted lease resets its refusals
            mw.served.setdefault(w.idx, set()).add(job.job_id)
            kept = job
    for followed in mw.jobs:
        followed.unfollow(w)
    w.alive = False
    w.leaves_s = min(w.leaves_s, env.now)
    mw.live.pop(w.idx, None)
