"""The simulated swarm: one SimPy environment with the job's trainers, validators, gossip and workers.

Processes: one per worker session (worker.py), the Poisson arrivals of new workers, the job's
step clock (trainers average: a step starts when one live trainer has a full trainable batch and
the others join its round at once with the trainable groups they have, as the product's trainer
does; under `trainers.join_rounds = false`, the rule before, when every live trainer has a full
batch or `averaging_timeout_s` after the first had one, with those that have one), the loss of a
trainer, and the timeline sampler. `World.run` advances the clock in slices so a run can stop
between them (Ctrl-C) and report how far it got.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from swarmrl.protocol.demand import IntakeMeter
from swarmrl.protocol.market import follows
from swarmrl.simulations.gossip import DeltaSpread
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.network import MBIT, Uplink
from swarmrl.simulations.pending import Pending
from swarmrl.simulations.population import Population, Worker
from swarmrl.simulations.profiles import MODEL_PROFILES
from swarmrl.simulations.regions import one_way_s
from swarmrl.simulations.scenario import JobShape, Scenario
from swarmrl.simulations.trainer import JOB_ID, SimTrainer
from swarmrl.simulations.validator import Validators
from swarmrl.simulations.worker import worker_life

TRAINER_REGIONS = ("na", "eu", "asia")


def schedule(env: simpy.Environment, at_s: float, fn: Callable[[], None]) -> None:
    """Call `fn` at simulated time `at_s` (s; now if that has passed)."""
    ev = env.timeout(max(0.0, at_s - env.now))
    ev.callbacks.append(lambda _ev: fn())


def arrivals(env: simpy.Environment, rng: random.Random, per_hour: float,
             spawn: Callable[[], object]) -> Generator[simpy.Event, Any, None]:
    """New workers as a Poisson process of `per_hour` arrivals (none at 0): `spawn` each."""
    rate = per_hour / 3600.0
    if rate <= 0:
        return
    while True:
        yield env.timeout(rng.expovariate(rate))
        spawn()


def advance(env: simpy.Environment, until_s: float, stop: Callable[[], bool], slice_s: float,
            progress: Callable[[float], None] | None) -> None:
    """Run `env` to `until_s` in slices of `slice_s` (s), calling `progress` with the time after
    each, until `stop()` says so (checked between slices: Ctrl-C, the jobs' end)."""
    while env.now < until_s and not stop():
        env.run(until=min(until_s, env.now + slice_s))
        if progress is not None:
            progress(env.now)


@dataclass(frozen=True)
class InMarket:
    """What a job's world shares with the others of a market (`market_world.MarketWorld`): the
    clock, the validators, and where its trainers sit (`first_region`: the first's of TRAINER_REGIONS)."""

    env: simpy.Environment
    validators: Validators
    first_region: int = 0


class World:
    """Everything of one run; built from a scenario, advanced by `run`. In a market (`market`
    given) one job's part of it: its trainers, step clock and gossip, on the market's clock and
    validators, with `job` (its knobs), `trainers` and `job_id`; the market owns the workers
    (spawns, arrivals, the timeline) and moves them between jobs (`follow`, `unfollow`)."""

    def __init__(self, sc: Scenario, *, market: InMarket | None = None, job: JobShape | None = None,
                 trainers: int | None = None, job_id: str = JOB_ID) -> None:
        self.sc, self.job, self.job_id = sc, job or sc.job, job_id
        self.env = market.env if market else simpy.Environment()
        self.profile = MODEL_PROFILES[self.job.model]
        self.rng = random.Random(f"world/{sc.seed}" + (f"/{job_id}" if market else ""))
        self.metrics = Metrics()
        self.population = Population(sc, self.profile)
        n = trainers or sc.trainers.count
        first = market.first_region if market else 0
        self.trainers = [SimTrainer(r, n, self.job, Uplink(TRAINER_REGIONS[(first + r) % 3], sc.network.trainer_up_mbit * MBIT),
                                    self.metrics, sc.validation.probation_s if sc.validation.validators else 0.0,
                                    sc.validation.probation_ends == "age_or_last_chance", job_id)
                         for r in range(n)]
        self.gossip = DeltaSpread(sc.gossip, self.profile.delta_bytes, self.profile.snapshot_bytes,
                                  sc.network.announce_s, f"{sc.seed}/{job_id}" if market else sc.seed, self.trainer_source)
        self.validators = market.validators if market else \
            Validators(sc.validation, sc.seed, self.metrics, self.schedule, self.ban, self.passed)
        self.version, self.done = 0, False
        self.intake = IntakeMeter()   # groups trained per minute lately: the record's intake
        self.workers: list[Worker] = []
        self.live: dict[int, Worker] = {}
        self.last_chosen: dict[int, float] = {}   # in a market: worker idx -> when it last chose this job
        self.last_granted: dict[int, float] = {}   # in a market: worker idx -> when it last got a lease of it
        self.waiting = [0] * n
        self.slot_freed = [self.env.event() for _ in range(n)]
        self.queued: list[list[simpy.Event]] = [[] for _ in range(n)]   # lease_rule "capacity": busy workers
        self.published = self.env.event()   # fires at the next version's publication (busy skips end early)
        if market is None:   # in a market, the market owns the workers
            for _ in range(sc.workers):
                self.spawn()
            self.env.process(self._arrivals())
        self.env.process(self._step_clock())
        if market is not None:
            return
        self.env.process(self._sampler())
        if sc.trainers.lost_at_s >= 0:
            self.schedule(sc.trainers.lost_at_s, self._lose_trainer)

    # ---- plumbing
    def schedule(self, at_s: float, fn: Callable[[], None]) -> None:
        """Call `fn` at simulated time `at_s` (s; now if that has passed)."""
        schedule(self.env, at_s, fn)

    def spawn(self) -> Worker:
        """A new worker, assigned a live trainer."""
        w = self.population.make(self.env.now)
        self.reassign(w)
        self.workers.append(w)
        self.env.process(worker_life(self, w))
        return w

    def trainer_source(self, w: Worker, at_s: float) -> tuple[Uplink, float]:
        """(uplink, gone_s) of the trainer `w` fetches adapters from at `at_s` (s): its own, or,
        `reconnect_s` after its own died, another (drawn by worker index; the lease loop draws
        its own). gone_s: when that trainer dies (inf: never)."""
        lost, doomed = self.sc.trainers.lost_at_s, self.trainers[-1]
        t = self.trainers[w.trainer]
        if lost < 0 or t is not doomed:
            return t.uplink, math.inf
        if at_s < lost + self.sc.trainers.reconnect_s:
            return t.uplink, lost
        others = self.trainers[:-1]
        return others[w.idx % len(others)].uplink, math.inf

    def reassign(self, w: Worker) -> None:
        """Point `w` at a uniformly drawn live trainer."""
        alive = [t.rank for t in self.trainers if t.alive]
        w.trainer = alive[self.rng.randrange(len(alive))]

    def join(self, w: Worker) -> None:
        """Add `w` to the live workers and the delta gossip."""
        self.live[w.idx] = w
        self.gossip.join(w, self.env.now)

    def leave(self, w: Worker) -> None:
        """Mark `w` gone now and drop it from the live workers."""
        w.alive = False
        w.leaves_s = min(w.leaves_s, self.env.now)
        self.live.pop(w.idx, None)

    def ban(self, w: Worker, why: str, job_id: str = "") -> None:
        """A validator's failed banning check reached the trainers: every trainer bans the peer
        (`job_id`: the job checked, this one; the signature is `Validators`' callback's)."""
        self.metrics.ban_reason(w, why)
        w.banned_s = min(w.banned_s, self.env.now)
        self.ban_at_trainers(w)

    def ban_at_trainers(self, w: Worker) -> None:
        """Every trainer of the job bans `w` (its untrained groups are wasted as "banned")."""
        for t in self.trainers:
            if w.peer_id not in t.banned:
                self.metrics.waste("banned", t.ban(w))

    def follow(self, w: Worker) -> float:
        """A market's worker chose this job: it follows the job's versions from now (the product
        opens the job's session and prefetches every version while it follows) and catches up
        before asking for a lease (deltas from the version it holds, or a snapshot first:
        `DeltaSpread.catch_up`). Returns when it holds the head (inf: no source served it)."""
        self.live[w.idx] = w
        self.last_chosen[w.idx] = self.env.now
        return self.gossip.catch_up(w, self.env.now)

    def chosen(self, w: Worker) -> None:
        """`w`, following this job, chose it again now (it keeps following: `market.follow_idle_s`)."""
        self.last_chosen[w.idx] = self.env.now

    def leased(self, w: Worker, granted: bool) -> None:
        """`market.follow_on = "grant"`: `w`'s lease round here ended, with a lease `granted` or
        refused. A grant keeps it following; a refusal with no grant within `follow_idle_s`
        ends its following now."""
        now = self.env.now
        if granted:
            self.last_granted[w.idx] = self.last_chosen[w.idx] = now
        elif not follows(self.last_granted.get(w.idx, -math.inf), now, self.sc.market.follow_idle_s):
            self.unfollow(w)

    def unfollow(self, w: Worker) -> None:
        """`w` stops following this job (its versions no longer reach it)."""
        self.live.pop(w.idx, None)
        self.last_chosen.pop(w.idx, None)
        self.last_granted.pop(w.idx, None)

    def _drop_idle_followers(self) -> None:
        """In a market: the workers that did not choose this job (`follow_on = "grant"`: get a
        lease of it) within `market.follow_idle_s` stop following it (`protocol.market.follows`: the product's worker
        stops prefetching such a job)."""
        now, idle = self.env.now, self.sc.market.follow_idle_s
        for idx in [i for i, t in self.last_chosen.items() if not follows(t, now, idle)]:
            self.live.pop(idx, None)
            del self.last_chosen[idx]

    def capacity(self) -> int:
        """Prompts the job's live trainers lease now (the records' capacity, summed), leases expired first."""
        if self.done:
            return 0
        now = int(self.env.now * 1000)
        for t in self.trainers:
            if t.alive:
                t.expire(now)
        return sum(t.capacity() for t in self.trainers if t.alive)

    def passed(self, w: Worker) -> None:
        """A validator passed `w` (as of `w.passed_s`): its groups at every trainer leave probation then."""
        for t in self.trainers:
            t.pending.passed(w)

    # ---- processes
    def _arrivals(self) -> Generator[simpy.Event, Any, None]:
        return arrivals(self.env, self.rng, self.sc.churn.joins_per_hour, self.spawn)

    def _step_clock(self) -> Generator[simpy.Event, Any, None]:
        job, prof = self.job, self.profile
        tick = max(0.01, min(0.25, prof.step_s(job.batch_groups) / 4))
        first_ready = None
        while not self.done:
            yield self.env.timeout(tick)
            self._wake_waiters()
            alive = [t for t in self.trainers if t.alive]
            ready = [t for t in alive if t.has_batch(self.env.now, self.version)]
            if not ready:
                first_ready = None
                continue
            if self.sc.trainers.join_rounds:   # the others join the round at once with what they have
                ready = alive
            elif len(ready) < len(alive):
                first_ready = self.env.now if first_ready is None else first_ready
                if self.env.now - first_ready < self.sc.trainers.averaging_timeout_s:
                    continue
            first_ready = None
            batches = {t.rank: t.take_batch(self.env.now, self.version, joining=True) for t in ready}
            yield self.env.timeout(self.step_s(len(ready), max(map(len, batches.values()))))
            self._publish(sum(len(b) for b in batches.values()))
            self._record_statements({rank: b for rank, b in batches.items() if b})

    def step_s(self, trainers: int, groups: int) -> float:
        """One step's time (s): `groups` per trainer (the largest batch of the step's trainers),
        publishing, and with several trainers an all-reduce between them."""
        step = self.profile.step_s(groups) + self.profile.publish_s
        if trainers > 1:   # a ring all-reduce of the LoRA gradients between the trainers
            step += 2 * self.profile.delta_bytes / (self.sc.network.trainer_up_mbit * MBIT) + 2 * one_way_s("na", "asia")
        return step

    def _record_statements(self, batches: dict[int, list[Pending]]) -> None:
        """Record what each trainer's contribution statement of the version just published
        credits (`Metrics.statements`): its batches, one per worker submission (a worker's groups
        admitted at the same instant came in one signed batch), for the audit model."""
        for rank, groups in batches.items():
            credited = len({(id(p.peer), p.admitted_s) for p in groups})
            self.metrics.statements.append((self.env.now, self.version, rank, credited))

    def _publish(self, trained: int) -> None:
        self.version += 1
        self.metrics.steps.append((self.env.now, self.version, trained))
        self.intake.add(self.env.now, trained)
        for t in self.trainers:
            t.published()
            if t.alive:
                t.drop_stale(self.version)
        self._drop_idle_followers()
        self.gossip.publish(self.version, self.env.now, list(self.live.values()))
        ev, self.published = self.published, self.env.event()
        ev.succeed()
        if self.job.steps and self.version >= self.job.steps:
            self.done = True
        self._wake_waiters()

    def wait_for_capacity(self, rank: int) -> simpy.Event:
        """lease_rule "capacity": an event that fires when trainer `rank` has capacity again
        (`_wake_waiters`: its record would announce it)."""
        ev = self.env.event()
        self.queued[rank].append(ev)
        return ev

    def stop_waiting(self, rank: int, ev: simpy.Event) -> None:
        """Take `ev` (of `wait_for_capacity(rank)`, not fired) out of the queue."""
        self.queued[rank].remove(ev)

    def _wake_waiters(self) -> None:
        for t in self.trainers:
            if self.job.lease_rule == "capacity":
                self._wake_some(t)
                continue
            if self.waiting[t.rank] and t.alive and self.job.backlog_counts_open:
                t.expire(int(self.env.now * 1000))   # an expired lease frees a slot under the open-lease rule
            if self.waiting[t.rank] and (not t.alive or self.done or not t.busy()):
                ev, self.slot_freed[t.rank] = self.slot_freed[t.rank], self.env.event()
                ev.succeed()

    def _wake_some(self, t: SimTrainer) -> None:
        """Wake every worker waiting for `t` once it has capacity (or is dead, or the job is
        done): the product's workers whose busy skip of `t` has ended read the capacity in its
        record and ask (those refused again skip it for longer: `worker.busy_skip_s`)."""
        queue = self.queued[t.rank]
        if not queue:
            return
        if t.alive and not self.done:
            t.expire(int(self.env.now * 1000))   # an expired lease frees its prompts' share of the promise
            if t.capacity() == 0:
                return
        self.queued[t.rank] = []
        for ev in queue:
            ev.succeed()

    def _lose_trainer(self) -> None:
        t = self.trainers[-1]   # trainer_source knows it is this one
        self.metrics.waste("trainer_lost", t.die())
        self._wake_waiters()

    def _sampler(self) -> Generator[simpy.Event, Any, None]:
        every = self.sc.timeline_every_s
        last_admitted = 0
        while True:
            yield self.env.timeout(every)
            admitted = self.metrics.counts["groups_admitted"]
            self.metrics.timeline.append(self.row((admitted - last_admitted) / every))
            last_admitted = admitted

    def row(self, ingest: float) -> dict[str, Any]:
        """One timeline row now: time (s), version, live workers, `ingest` rate and the counters."""
        m = self.metrics
        return {"t_s": round(self.env.now, 1), "version": self.version, "live_workers": len(self.live),
                "waiting_workers": sum(self.waiting) + sum(map(len, self.queued)), "pending_groups": sum(len(t.pending) for t in self.trainers),
                "groups_admitted": m.counts["groups_admitted"], "groups_wasted": sum(m.wasted.values()),
                "cheaters_banned": sum(1 for w in self.workers if w.cheater and w.banned_s <= self.env.now),
                "trainer_upload_bytes": self.gossip.trainer_bytes, "peer_upload_bytes": self.gossip.peer_bytes,
                "ingest_groups_per_s": round(ingest / max(1, sum(t.alive for t in self.trainers)), 3)}

    def simpy_events(self) -> int:
        """How many events the SimPy environment has scheduled so far (its event id counter)."""
        eid: itertools.count[int] = self.env._eid   # SimPy keeps no public count
        return next(eid)

    # ---- running
    def run(self, until_s: float, should_stop: Callable[[], bool], slice_s: float = 60.0,
            progress: Callable[[float], None] | None = None) -> float:
        """Advance to `until_s` (or the job's end); returns the simulated time reached."""
        advance(self.env, until_s, lambda: self.done or should_stop(), slice_s, progress)
        for t in self.trainers:
            self.metrics.count("prompts_reissued", sum(c - 1 for c in t.issued.values() if c > 1))
        return self.env.now
