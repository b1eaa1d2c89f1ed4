"""Who the workers are: GPU class and speed, region and links, NAT, cheating mode, session length.

Draws come from one `random.Random` per purpose (seeded from the scenario), so a run is a pure
function of its scenario.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, cast

from swarmrl.simulations.cheaters import HONEST
from swarmrl.simulations.network import MBIT, Uplink
from swarmrl.simulations.profiles import ModelProfile
from swarmrl.simulations.scenario import Scenario


@dataclass(eq=False)
class Worker:
    """One volunteer's session (a rejoin is a new worker: a new key, as the product sees it)."""

    idx: int
    peer_id: str
    gpu: str
    tokens_per_s: float
    region: str
    down_bps: float
    uplink: Uplink
    nat: bool
    mode: str
    joined_s: float
    leaves_s: float
    trainer: int = 0
    alive: bool = True
    banned_s: float = math.inf
    first_submit_s: float = math.inf
    passed_s: float = math.inf        # first passing verdict from a validator (ends probation)
    checked: int = 0                  # validator's counts (validator/policy.py reads them)
    passed: int = 0
    last_failure_s: float = -math.inf
    generating_s: float = 0.0
    snapshot_version: int = -1
    stats: dict[str, Any] = field(default_factory=dict)
    refusals: dict[int, int] = field(default_factory=dict)     # trainer rank -> busy refusals in a row
    skips: dict[int, tuple[float, float, int]] = field(default_factory=dict)   # trainer rank -> busy skip
    # (until s, earliest early end s, head version when refused): worker.skipped reads it
    market_refusals: dict[tuple[str, int], int] = field(default_factory=dict)   # in a market: (job, rank) -> refusals
    market_skips: dict[tuple[str, int], tuple[float, float, int]] = field(default_factory=dict)   # (job, rank) -> skip
    market_banned: set[str] = field(default_factory=set)   # in a market: the jobs whose trainers banned it

    @property
    def reachable(self) -> bool:
        """True when peers can connect to this worker (not behind NAT)."""
        return not self.nat

    @property
    def cheater(self) -> bool:
        """True for any mode but honest."""
        return self.mode != HONEST


def _pick(rng: random.Random, shares: dict[str, float]) -> str:
    keys = sorted(shares)
    return rng.choices(keys, weights=[shares[k] for k in keys])[0]


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


class Population:
    """Makes workers for a scenario; `session_s` draws a Lomax (Pareto II) session length."""

    def __init__(self, sc: Scenario, profile: ModelProfile) -> None:
        self.sc, self.profile = sc, profile
        self.rng = random.Random(f"population/{sc.seed}")
        self.count = 0
        modes = sc.cheaters.modes
        self._modes = modes
        a = sc.churn.session_shape
        m = sc.churn.median_session_s
        self._lomax_scale = m / (2 ** (1 / a) - 1) if m > 0 else 0.0

    def session_s(self) -> float:
        """A session length in seconds drawn from the churn's Lomax law (inf when churn is off)."""
        if self._lomax_scale <= 0:
            return math.inf
        u = 1.0 - self.rng.random()
        return self._lomax_scale * (cast(float, u ** (-1 / self.sc.churn.session_shape)) - 1)  # float ** float is typed Any

    def make(self, now: float) -> Worker:
        """A new worker joining at simulated time `now` (s): GPU, region, uplink, mode and leave time drawn."""
        sc, rng, net = self.sc, self.rng, self.sc.network
        idx = self.count
        self.count += 1
        gpu = _pick(rng, {k: v for k, v in sc.gpu_mix.items() if k in self.profile.tokens_per_s} or {"cpu": 1.0})
        speed = _lognormal(rng, self.profile.tokens_per_s[gpu], self.profile.speed_spread)
        region = _pick(rng, net.region_shares)
        slow = net.slow_factor if region == net.slow_region else 1.0
        down = _lognormal(rng, net.worker_down_mbit, net.spread) * MBIT / slow
        up = _lognormal(rng, net.worker_up_mbit, net.spread) * MBIT / slow
        nat = rng.random() < net.nat_share
        mode = ""
        if sc.cheaters.share > 0 and rng.random() < sc.cheaters.share:
            mode = self._modes[rng.randrange(len(self._modes))]
        return Worker(idx=idx, peer_id=f"w{idx:06d}", gpu=gpu, tokens_per_s=speed, region=region, down_bps=down,
                      uplink=Uplink(region, up), nat=nat, mode=mode, joined_s=now, leaves_s=now + self.session_s())
