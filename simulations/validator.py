"""Validators on the simulated clock: the real sampling policy and draw, a queue of work, verdicts.

A validator reads admitted batches at its next round (`poll_s`), asks the peer's rate of
`validator/policy.py` (1 for a peer with fewer than 16 verdicts, then decaying toward the base
rate), draws each group with `validator/sampling.plan_group` (regrade at the rate, the log-prob
prefill at rate**2 among those), and spends `regrade_s` / `prefill_s` per group on it. A checked
group of a cheating mode fails its rung (cheaters.VALIDATOR_CAUGHT); a failed banning check bans
the peer at every trainer of the job the group was for when the verdict is ready (the product's
trainers act on the verdicts of their own job: `Admission.apply_verdicts`); a passing one ends
the peer's probation then (`passed`: the trainers' pending pools). Honest peers never fail (no
false positives).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable
from typing import cast

from swarmrl.simulations import cheaters as ch
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.population import Worker
from swarmrl.simulations.scenario import Validation
from swarmrl.validator import policy
from swarmrl.validator.sampling import plan_group

Schedule = Callable[[float, Callable[[], None]], None]


class Validators:
    """The job's validators as one pool of `validators` servers."""

    def __init__(self, cfg: Validation, seed: int, metrics: Metrics, schedule: Schedule,
                 ban: Callable[[Worker, str, str], None], passed: Callable[[Worker], None] = lambda w: None) -> None:
        self.cfg, self.m, self.schedule, self.ban, self.passed = cfg, metrics, schedule, ban, passed
        self.key = hashlib.sha256(f"validator/{seed}".encode()).digest()
        self.rng = random.Random(f"validator/{seed}")
        self.free_s = [0.0] * cfg.validators
        self.phase = [self.rng.uniform(0, cfg.poll_s) for _ in range(cfg.validators)]
        self.batches = 0

    @property
    def enabled(self) -> bool:
        """True when the scenario has any validators."""
        return self.cfg.validators > 0

    def rate(self, w: Worker, now_s: float) -> float:
        """The share of `w`'s groups sampled at `now_s` (s): the validator's policy.sample_rate."""
        since = None if not math.isfinite(w.last_failure_s) else int((now_s - w.last_failure_s) * 1000)
        return policy.sample_rate(self.cfg.sample_rate, checked=w.checked, passed=w.passed, soft_flags=0,
                                  banned=w.banned_s <= now_s, since_failure_ms=since)

    def review(self, w: Worker, indices: list[int], lease_version: int, now_s: float, job_id: str = "") -> None:
        """Queue the admitted groups `indices` of one batch of `w` for job `job_id` (leased at
        `lease_version`); a failed banning check calls `ban(w, why, job_id)` at the verdict."""
        if not self.enabled or not indices:
            return
        self.batches += 1
        batch_id = f"b{self.batches}"
        rate = self.rate(w, now_s)
        plans = [plan_group(self.key, batch_id, i, rate) for i in indices]
        checked = sum(p.regrade for p in plans)
        if not checked:
            return
        v = min(range(len(self.free_s)), key=self.free_s.__getitem__)
        poll = self.cfg.poll_s
        read = self.phase[v] + math.ceil((now_s - self.phase[v]) / poll) * poll
        cost = self.cfg.regrade_s * checked + self.cfg.prefill_s * sum(p.logprob for p in plans)
        done = max(read, self.free_s[v]) + cost
        self.free_s[v] = done
        self.m.verdict_delay_s.append(done - now_s)
        catch = ch.validator_detects(w.mode, lease_version)
        failed = catch is not None and any(
            (p.logprob if catch.rung == "logprob" else p.regrade) and self.rng.random() < catch.p_detect for p in plans)
        w.checked += checked
        if failed:
            w.last_failure_s = done
            self.schedule(done, lambda: self.ban(w, f"validator:{cast(ch.ValidatorCatch, catch).rung}", job_id))  # failed: caught
        else:
            w.passed += checked
            w.passed_s = min(w.passed_s, done)
            self.passed(w)
