"""The simulated trainer's pending pool counts and takes trainable groups as the probation rule
says (JobRuntime.trainable_cutoff: the peer passed a check, the group is probation_s old, or, with
the last chance, its version is at the step's staleness floor), without scanning the pool on
every ask."""

from __future__ import annotations

import math
import random

import pytest

from swarmrl.simulations.network import Uplink
from swarmrl.simulations.pending import Pending, PendingPool
from swarmrl.simulations.population import Worker


def peer(idx: int) -> Worker:
    return Worker(idx=idx, peer_id=f"p{idx}", gpu="rtx4090", tokens_per_s=2000.0, region="na", down_bps=1e9,
                  uplink=Uplink("na", 1e9), nat=False, mode="", joined_s=0.0, leaves_s=math.inf)


def rule(p: Pending, now: float, probation_s: float, floor: int | None = None) -> bool:
    return probation_s <= 0 or p.peer.passed_s <= now or p.admitted_s <= now - probation_s or \
        (floor is not None and p.version <= floor)


@pytest.mark.parametrize("last_chance", [False, True])
def test_the_pool_agrees_with_the_probation_rule_through_adds_passes_steps_and_drops(last_chance):
    rng = random.Random(0)
    peers = [peer(i) for i in range(8)]
    pool, model = PendingPool(probation_s=60.0, last_chance=last_chance), []
    now, floor = 0.0, -3   # the steps' staleness floor only rises (version - max_async_level)
    for _ in range(3000):
        now += rng.uniform(0, 2)
        floor += rng.random() < 0.02
        op = rng.random()
        if op < 0.5:
            groups = [Pending(rng.choice(peers), rng.randrange(10), now) for _ in range(rng.randint(1, 4))]
            pool.add(groups, now)
            model.extend(groups)
        elif op < 0.6:
            w = rng.choice(peers)
            w.passed_s = min(w.passed_s, now + rng.uniform(0, 30))   # a verdict due now or later
            pool.passed(w)
        elif op < 0.75:
            want = [p for p in model if rule(p, now, 60.0, floor if last_chance else None)][:5]
            assert pool.take(5, now, floor) == want
            model = [p for p in model if p not in want]
        elif op < 0.8:
            cut = rng.randrange(10)
            assert pool.drop(lambda p, cut=cut: p.version < cut) == sum(p.version < cut for p in model)
            model = [p for p in model if p.version >= cut]
        assert len(pool) == len(model)
        assert pool.trainable(now, floor) == sum(rule(p, now, 60.0, floor if last_chance else None) for p in model)
    assert pool.clear() == len(model) and len(pool) == 0 and pool.trainable(now) == 0


def test_without_probation_every_group_is_trainable_at_once():
    pool = PendingPool(probation_s=0.0)
    pool.add([Pending(peer(0), 0, 5.0) for _ in range(3)], 5.0)
    assert pool.trainable(5.0) == 3 and len(pool.take(2, 5.0)) == 2
    assert pool.trainable(5.0) == 1 and len(pool) == 1
