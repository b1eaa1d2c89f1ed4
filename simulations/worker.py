"""A worker's session as one SimPy process: find the job, catch up, then lease rounds until it leaves.

One round is one event (lease -> catch up -> generate -> grade -> sign -> submit, as
`JobSession.work_once`), timed by the worker's speed and links. A worker told "busy" goes at once
to another live trainer of the job that has capacity (`SimTrainer.capacity`), as the product's
worker skips a trainer that refused; when none has, it waits for its trainer to free a slot and
retries at its next poll (no event per poll; under the lease rule "capacity" only as many waiters
are woken as the freed capacity has leases for); a worker whose session
ends mid-lease crashes there: its lease stays open in the trainer's LeaseBook until it expires
and its prompts are handed out again.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol

from swarmrl.protocol import admission as adm
from swarmrl.protocol.leases import BUSY_RETRY_MS
from swarmrl.simulations.gossip import GIVE_UP_S
from swarmrl.simulations.network import send_s
from swarmrl.simulations.population import Worker

if TYPE_CHECKING:
    import simpy

    from swarmrl.simulations.gossip import DeltaSpread
    from swarmrl.simulations.metrics import Metrics
    from swarmrl.simulations.profiles import ModelProfile
    from swarmrl.simulations.scenario import Scenario
    from swarmrl.simulations.trainer import SimTrainer
    from swarmrl.simulations.validator import Validators

JOB_POLL_S = 1.0   # worker config poll_s: how often a worker looks for jobs


class WorkerWorld(Protocol):
    """What a worker's session reads and calls of the simulated swarm (`world.World` is one)."""

    env: simpy.Environment
    sc: Scenario
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

    def wait_for_capacity(self, rank: int) -> simpy.Event:
        """Fires when trainer `rank` has capacity for one more lease (lease_rule "capacity")."""

    def asking(self, rank: int) -> None:
        """A worker woken by `wait_for_capacity(rank)` asks again now."""

    def stop_waiting(self, rank: int, ev: simpy.Event) -> None:
        """A worker stops waiting on `ev` of `wait_for_capacity(rank)` (its session ended)."""

    def join(self, w: Worker) -> None:
        """The worker joins the swarm (and the delta gossip)."""

    def leave(self, w: Worker) -> None:
        """The worker's session ends."""

    def reassign(self, w: Worker) -> None:
        """Move the worker to a live trainer (its own was lost)."""


def _busy(world: WorkerWorld, w: Worker, tr: SimTrainer) -> Generator[simpy.Event, Any, None]:
    """`tr` refused `w` as busy: under the lease rule "capacity", another live trainer with
    capacity at once, else wait for `tr`'s; under "pending" (the rule before), wait for a slot."""
    if world.sc.job.lease_rule != "capacity":
        world.waiting[tr.rank] += 1
        yield world.slot_freed[tr.rank]
        world.waiting[tr.rank] -= 1
        yield world.env.timeout(world.rng.uniform(0, BUSY_RETRY_MS / 1000))
        return
    others = [t.rank for t in world.trainers if t.alive and t is not tr and t.capacity() > 0]
    if others:
        w.trainer = others[world.rng.randrange(len(others))]
        return
    ev = world.wait_for_capacity(tr.rank)
    if math.isinf(w.leaves_s):
        yield ev
    else:   # a worker whose session ends while it waits leaves then (else it would linger as a holder)
        yield ev | world.env.timeout(max(0.0, w.leaves_s - world.env.now))
        if not ev.triggered:
            world.stop_waiting(tr.rank, ev)
            return
    yield world.env.timeout(world.rng.uniform(0, BUSY_RETRY_MS / 1000))
    world.asking(tr.rank)


def worker_life(world: WorkerWorld, w: Worker) -> Generator[simpy.Event, Any, None]:
    """The process of one worker session."""
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
        status, lease = tr.request_lease(w, env.now, world.version, world.done)
        if status in (adm.BANNED, "job_done"):
            break
        if status == "busy":
            yield from _busy(world, w, tr)
            continue
        assert lease is not None
        n = len(lease.prompt_indices)
        gen_s = n * world.sc.job.group_size * world.profile.tokens_per_completion / w.tokens_per_s \
            + world.profile.round_overhead_s
        rollout_bytes = int(n * world.sc.job.group_size * world.profile.tokens_per_completion
                            * world.profile.rollout_bytes_per_token)
        ready = world.gossip.held_at(w, lease.policy_version)
        if math.isinf(ready):   # AdapterBehind: no source served it; catch up afresh, retry the lease
            world.metrics.count("adapter_behind")
            ready = world.gossip.join(w, env.now)
            if math.isinf(ready):   # that catch-up failed for GIVE_UP_S too: the next lease after it
                yield env.timeout(min(GIVE_UP_S, max(JOB_POLL_S, w.leaves_s - env.now)))
                continue
        start = max(env.now + 2 * send_s(w.region, tr.uplink.region, w.uplink.up_bps, 200), ready)
        end = start + gen_s + send_s(w.region, tr.uplink.region, w.uplink.up_bps, rollout_bytes)
        if end >= w.leaves_s:   # crashes mid-lease: the lease expires at the trainer
            yield env.timeout(max(0.0, w.leaves_s - env.now))
            world.metrics.count("groups_generated", n)
            world.metrics.waste("churn", n)
            break
        yield env.timeout(end - env.now)
        w.generating_s += gen_s
        if not tr.alive:
            world.metrics.count("groups_generated", n)
            world.metrics.waste("trainer_lost", n)
            continue
        w.first_submit_s = min(w.first_submit_s, env.now)
        admitted = tr.submit(w, lease, env.now, world.version)
        world.validators.review(w, list(lease.prompt_indices[: len(admitted)]), lease.policy_version, env.now)
    world.leave(w)
