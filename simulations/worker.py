"""A worker's session as one SimPy process: find the job, catch up, then lease rounds until it leaves.

One round is one event (lease -> catch up -> generate -> grade -> sign -> submit, as
`JobSession.work_once`), timed by the worker's speed and links. A worker told "busy": under the
lease rule "capacity" (the product's now), skips that trainer for 1, 2, 4 ... 60 s (its refusals in
a row, ending early once the trainer steps: `node/worker/market.py`), goes at once to a trainer it does not skip that has capacity,
else waits until one has (its record would say so) and asks at its next poll; under "pending" (the
rule before) it waits for its trainer to free a slot and retries at its next poll. No event per
poll either way. A worker whose session ends mid-lease crashes there: its lease stays open in the trainer's LeaseBook until it expires
and its prompts are handed out again.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol

from swarmrl.protocol import admission as adm
from swarmrl.protocol.leases import BUSY_RETRY_MS
from swarmrl.protocol.market import BUSY_SKIP_MAX_S, busy_skip, skip_ends
from swarmrl.simulations.gossip import GIVE_UP_S
from swarmrl.simulations.network import send_s
from swarmrl.simulations.population import Worker

if TYPE_CHECKING:
    import simpy

    from swarmrl.simulations.gossip import DeltaSpread
    from swarmrl.simulations.metrics import Metrics
    from swarmrl.simulations.profiles import ModelProfile
    from swarmrl.simulations.scenario import JobShape, Scenario
    from swarmrl.simulations.trainer import SimTrainer
    from swarmrl.simulations.validator import Validators

JOB_POLL_S = 1.0   # worker config poll_s: how often a worker looks for jobs
HEAD_WAIT_MAX_S = 30.0   # what-if job.ask_at_head: the longest a worker waits to hold the head before asking


class WorkerWorld(Protocol):
    """What a worker's session reads and calls of the simulated swarm (`world.World` is one)."""

    env: simpy.Environment
    sc: Scenario
    job: JobShape   # this job's knobs (the scenario's job, or one job of its market)
    job_id: str
    profile: ModelProfile
    rng: Any   # random.Random
    metrics: Metrics
    trainers: list[SimTrainer]
    gossip: DeltaSpread
    validators: Validators
    version: int
    done: bool
    waiting: list[int]
    slot_freed: list[simpy.Event]
    published: simpy.Event   # fires at the next version's publication (then replaced)

    def wait_for_capacity(self, rank: int) -> simpy.Event:
        """Fires when trainer `rank` has capacity for one more lease (lease_rule "capacity")."""

    def stop_waiting(self, rank: int, ev: simpy.Event) -> None:
        """A worker stops waiting on `ev` of `wait_for_capacity(rank)` (its session ended)."""

    def join(self, w: Worker) -> None:
        """The worker joins the swarm (and the delta gossip)."""

    def leave(self, w: Worker) -> None:
        """The worker's session ends."""

    def reassign(self, w: Worker) -> None:
        """Move the worker to a live trainer (its own was lost)."""


def busy_skip_s(refusals: int) -> float:
    """How long a trainer is skipped after `refusals` (>= 1) busy refusals in a row: the product
    worker's rule (`protocol.market.busy_skip`) with the trainer's fixed retry hint."""
    return busy_skip(BUSY_RETRY_MS / 1000, refusals)[0]


def skip_ends_s(w: Worker, rank: int, version: int) -> float:
    """When `w`'s busy skip of trainer `rank` ends (0.0: not skipped), the head being `version`
    (`protocol.market.skip_ends`)."""
    until, earliest, head = w.skips.get(rank, (0.0, 0.0, 0))
    return skip_ends(until, earliest, head, version)


def _busy(world: WorkerWorld, w: Worker, tr: SimTrainer) -> Generator[simpy.Event, Any, None]:
    """`tr` refused `w` as busy. Under the lease rule "pending" (the rule before): wait for a slot.
    Under "capacity", as the product's worker (`JobMarket.refused_busy`, `skipped`): skip `tr`
    (`busy_skip_s`, `skip_ends_s`); go at once to a live trainer not skipped that has capacity;
    else wait until one not skipped has capacity (its record says so), or a skip may end."""
    if world.job.lease_rule != "capacity":
        world.waiting[tr.rank] += 1
        yield world.slot_freed[tr.rank]
        world.waiting[tr.rank] -= 1
        yield world.env.timeout(world.rng.uniform(0, BUSY_RETRY_MS / 1000))
        return
    env = world.env
    k = w.refusals[tr.rank] = w.refusals.get(tr.rank, 0) + 1
    skip, base = busy_skip(BUSY_RETRY_MS / 1000, k)
    w.skips[tr.rank] = (env.now + skip, env.now + base, world.version)
    while env.now < w.leaves_s:
        alive = [t for t in world.trainers if t.alive]
        open_ = [t for t in alive if skip_ends_s(w, t.rank, world.version) <= env.now]
        ready = [t for t in open_ if t.capacity() > 0]
        if ready or not alive:
            w.trainer = ready[world.rng.randrange(len(ready))].rank if ready else w.trainer
            return
        if not open_:   # every trainer skipped: look again when the first skip ends or a step is published
            ends = min(skip_ends_s(w, t.rank, world.version) for t in alive)
            yield env.timeout(ends - env.now) | world.published
            continue
        t = open_[world.rng.randrange(len(open_))]
        ev = world.wait_for_capacity(t.rank)
        yield ev | env.timeout(max(0.0, min(w.leaves_s, env.now + BUSY_SKIP_MAX_S) - env.now))
        if not ev.triggered:   # the session ended (else it would linger as a holder), or a long quiet
            world.stop_waiting(t.rank, ev)
            continue
        yield env.timeout(world.rng.uniform(0, JOB_POLL_S))   # its next poll reads the record
        w.trainer = t.rank
        return


def _await_head(world: WorkerWorld, w: Worker) -> Generator[simpy.Event, Any, None]:
    """What-if `job.ask_at_head`: wait (polling every JOB_POLL_S) until `w` holds the head version,
    at most HEAD_WAIT_MAX_S or until its session ends."""
    env = world.env
    until = min(env.now + HEAD_WAIT_MAX_S, w.leaves_s)
    while env.now < until:
        held = world.gossip.held_at(w, world.version)
        if held <= env.now:
            return
        yield env.timeout(min(held, env.now + JOB_POLL_S, until) - env.now)


def lease_round(world: WorkerWorld, w: Worker, tr: SimTrainer) -> Generator[simpy.Event, Any, str]:
    """One lease round of `w` with trainer `tr` (as `JobSession.work_once`): ask for a lease (once
    `w` holds the head, under `job.ask_at_head`), catch up, generate, submit. Returns what came of
    it: "leased" (a batch submitted, or lost with its trainer), "busy", "banned", "job_done",
    "behind" (no source served the lease's version: the next lease catches up afresh) or
    "crashed" (the session ended mid-lease: the lease expires at the trainer)."""
    env, job = world.env, world.job
    if job.ask_at_head:
        yield from _await_head(world, w)
    status, lease = tr.request_lease(w, env.now, world.version, world.done)
    if status != "lease":
        return status
    assert lease is not None
    n = len(lease.prompt_indices)
    gen_s = n * job.group_size * world.profile.tokens_per_completion / w.tokens_per_s \
        + world.profile.round_overhead_s
    rollout_bytes = int(n * job.group_size * world.profile.tokens_per_completion
                        * world.profile.rollout_bytes_per_token)
    ready = world.gossip.held_at(w, lease.policy_version)
    if math.isinf(ready):   # AdapterBehind: no source served it; catch up afresh, retry the lease
        world.metrics.count("adapter_behind")
        ready = world.gossip.join(w, env.now)
        if math.isinf(ready):   # that catch-up failed for GIVE_UP_S too: the next lease after it
            yield env.timeout(min(GIVE_UP_S, max(JOB_POLL_S, w.leaves_s - env.now)))
            return "behind"
    start = max(env.now + 2 * send_s(w.region, tr.uplink.region, w.uplink.up_bps, 200), ready)
    end = start + gen_s + send_s(w.region, tr.uplink.region, w.uplink.up_bps, rollout_bytes)
    if end >= w.leaves_s:   # crashes mid-lease: the lease expires at the trainer
        yield env.timeout(max(0.0, w.leaves_s - env.now))
        world.metrics.count("groups_generated", n)
        world.metrics.waste("churn", n)
        return "crashed"
    yield env.timeout(end - env.now)
    w.generating_s += gen_s
    if not tr.alive:
        world.metrics.count("groups_generated", n)
        world.metrics.waste("trainer_lost", n)
        return "leased"
    w.first_submit_s = min(w.first_submit_s, env.now)
    admitted = tr.submit(w, lease, env.now, world.version)
    world.validators.review(w, list(lease.prompt_indices[: len(admitted)]), lease.policy_version, env.now, world.job_id)
    return "leased"


def worker_life(world: WorkerWorld, w: Worker) -> Generator[simpy.Event, Any, None]:
    """The process of one worker session (one job: the scenario's)."""
    env = world.env
    yield env.timeout(max(0.0, world.sc.job_start_s - env.now) + world.rng.uniform(0, JOB_POLL_S))
    if env.now >= w.leaves_s:
        world.leave(w)
        return
    world.join(w)
    while env.now < w.leaves_s:
        tr = world.trainers[w.trainer]
        if not tr.alive:
            yield env.timeout(world.sc.trainers.reconnect_s)
            world.reassign(w)
            continue
        status = yield from lease_round(world, w, tr)
        if status in (adm.BANNED, "job_done", "crashed"):
            break
        if status == "busy":
            yield from _busy(world, w, tr)
        else:   # "leased" or "behind": a granted lease resets its busy refusals (JobMarket.granted)
            w.refusals.pop(tr.rank, None)
    world.leave(w)
