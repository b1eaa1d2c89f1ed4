"""The simulated trainer's pending pool counts and takes trainable groups as the probation rule
says (JobRuntime.trainable_cutoff: the peer passed a check, or the group is probation_s old),
without scanning the pool on every ask."""

from __future__ import annotations

import math
import random

from swarmrl.simulations.network import Uplink
from swarmrl.simulations.pending import Pending, PendingPool
from swarmrl.simulations.population import Worker


def peer(idx: int) -> Worker:
    return Worker(idx=idx, peer_id=f"p{idx}", gpu="rtx4090", tokens_per_s=2000.0, region="na", down_bps=1e9,
                  uplink=Uplink("na", 1e9), nat=False, mode="", joined_s=0.0, leaves_s=math.inf)


def rule(p: Pending, now: float, probation_s: float) -> bool:
    return probation_s <= 0 or p.peer.passed_s <= now or p.admitted_s <= now - probation_s


def test_the_pool_agrees_with_the_probation_rule_through_adds_passes_steps_and_drops():
    rng = random.Random(0)
    peers = [peer(i) for i in range(8)]
    pool, model = PendingPool(probation_s=60.0), []
    now = 0.0
    for _ in range(3000):
        now += rng.uniform(0, 2)
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
            want = [p for p in model if rule(p, now, 60.0)][:5]
            assert pool.take(5, now) == want
            model = [p for p in model if p not in want]
        elif op < 0.8:
            floor = rng.randrange(10)
            assert pool.drop(lambda p, floor=floor: p.version < floor) == sum(p.version < floor for p in model)
            model = [p for p in model if p.version >= floor]
        assert len(pool) == len(model)
        assert pool.trainable(now) == sum(rule(p, now, 60.0) for p in model)
    assert pool.clear() == len(model) and len(pool) == 0 and pool.trainable(now) == 0


def test_without_probation_every_group_is_trainable_at_once():
    pool = PendingPool(probation_s=0.0)
    pool.add([Pending(peer(0), 0, 5.0) for _ in range(3)], 5.0)
    assert pool.trainable(5.0) == 3 and len(pool.take(2, 5.0)) == 2
    assert pool.trainable(5.0) == 1 and len(pool) == 1
