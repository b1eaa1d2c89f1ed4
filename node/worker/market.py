"""The worker's side of the market: which job's record it may follow, which job it serves next,
and which trainers it skips for a while after they refused a lease they had announced.

- A record whose demand is missing or absurd (`protocol.demand.check_demand`) is ignored, its
  reason logged once per job (until it changes) and kept in `ignored` (the worker's report).
- The job is picked by the pure rule `protocol.market.choose_job` (weighted power-of-two
  choices), keeping the job served now while it wants work; a worker whose engine batches
  several jobs' adapters picks a round's set of jobs by `protocol.lease_set.plan_round`, the
  same rule once per place, keeping the last round's jobs while they want work.
- A trainer that announced capacity and then refused a lease as `busy` is skipped for that job
  for `max(retry hint, BUSY_SKIP_S) * 2 ** (k - 1)` seconds (at most `BUSY_SKIP_MAX_S`), k its
  broken promises in a row (a granted lease resets k): the worker goes to another job at once,
  and a trainer that keeps refusing is asked less and less often, never in a loop. The skip
  ends early, though never before `max(retry hint, BUSY_SKIP_S)`, once the trainer announces a
  newer head version: it stepped, so its pending groups went into a version and its capacity
  is fresh (the rule: `protocol.market.busy_skip`, `skip_ends`). An honest trainer that is
  busy because it is the bottleneck is asked again after each step (as often as before the market: a `busy` cost a worker a 1 s wait), and a trainer
  that only re-announces its claim gets the back-off. Measured on `swarmrl up` (tiny, 4 workers,
  8 steps, one run each on a loaded machine): without the early end, steps 1 -> 8 took 7.1 s
  (3.9-4.3 s with it, 3.8-6.5 s on main), workers waiting up to 4 s behind a trainer that stepped
  every 0.5 s.

The clock is injected (monotonic seconds), so tests move time instead of sleeping.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping

from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.protocol.demand import check_demand
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.lease_set import plan_round
from swarmrl.protocol.market import MAX_WEIGHT, Offer, busy_skip, choose_job, skip_ends

log = logging.getLogger(__name__)


class JobMarket:
    """One worker's job choice (not thread-safe: the worker's main loop owns it).

    max_weight: records announcing a weight above it are ignored (`WorkerConfig.max_job_weight`).
    rng: the rule's randomness (default: seeded from the OS). clock: monotonic seconds.
    """

    def __init__(self, max_weight: float = MAX_WEIGHT, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_weight, self.clock = max_weight, clock
        self.rng = rng or random.Random()
        self.kept: list[str] = []   # the jobs served in the last round (kept while they want work)
        self.ignored: dict[str, str] = {}   # job id -> why its records are ignored now
        # (job, trainer) -> (skipped until, not ended early before, head version when refused)
        self._skip: dict[tuple[str, str], tuple[float, float, int]] = {}
        self._broken: dict[tuple[str, str], int] = {}   # (job, trainer) -> broken promises in a row

    @property
    def current(self) -> str | None:
        """The job served now, for a worker serving one job a round (the first kept job)."""
        return self.kept[0] if self.kept else None

    @current.setter
    def current(self, job_id: str | None) -> None:
        self.kept = [] if job_id is None else [job_id]

    def sound(self, records: list[VerifiedRecord], spec: JobSpec) -> list[VerifiedRecord]:
        """The records of one job whose demand is sound; the reason the others are ignored is
        logged once (per job, until it changes)."""
        ok, reasons = [], []
        for r in records:
            reason = check_demand(r.record, spec, self.max_weight)
            if reason:
                reasons.append(f"trainer {r.trainer_id[:12]}: {reason}")
            else:
                ok.append(r)
        job_id = records[0].record.job_id if records else ""
        if ok or not reasons:
            self.ignored.pop(job_id, None)
        elif self.ignored.get(job_id) != reasons[0]:
            self.ignored[job_id] = reasons[0]
            log.warning("ignoring job %s: %s", job_id, reasons[0])
        return ok

    def forget_except(self, job_ids: set[str]) -> None:
        """Forget why jobs no longer announced were ignored."""
        for job_id in [j for j in self.ignored if j not in job_ids]:
            del self.ignored[job_id]

    def skipped(self, rec: VerifiedRecord) -> bool:
        """Whether the record's trainer is skipped for its job now: it broke a promise lately, and
        has not announced a newer head version since (or did so within the base skip)."""
        until, earliest, head = self._skip.get((rec.record.job_id, rec.trainer_id), (0.0, 0.0, 0))
        return skip_ends(until, earliest, head, int(rec.record.head_version)) > self.clock()

    def offers(self, live: Mapping[str, VerifiedRecord]) -> list[Offer]:
        """The jobs of `live` (job id -> the record followed) as the rule sees them, less those
        whose trainer broke a promise lately."""
        return [Offer(j, int(r.record.demand.capacity), r.record.demand.intake_per_min, r.record.demand.weight)
                for j, r in live.items() if not self.skipped(r)]

    def pick(self, live: Mapping[str, VerifiedRecord]) -> str | None:
        """The job to serve next among `live` (job id -> the record followed), keeping the current
        one while it wants work; None when none wants work."""
        return choose_job(self.offers(live), self.rng, current=self.current, cap=self.max_weight)

    def plan(self, live: Mapping[str, VerifiedRecord], k: int, *, keep: bool = True) -> list[str]:
        """Up to `k` jobs of `live` to lease from in one round (`protocol.lease_set.plan_round`),
        the kept jobs challenged once each (`keep=False`: none, to fill places a busy refusal left)."""
        return plan_round(self.offers(live), self.rng, kept=self.kept if keep else (), k=k, cap=self.max_weight)

    def granted(self, rec: VerifiedRecord) -> None:
        """The record's trainer leased work: forget its broken promises (`keep` says which jobs stay)."""
        self._broken.pop((rec.record.job_id, rec.trainer_id), None)

    def keep(self, job_ids: list[str]) -> None:
        """The jobs whose trainers granted this round's leases: kept while they want work."""
        self.kept = list(dict.fromkeys(job_ids))

    def refused_busy(self, rec: VerifiedRecord, retry_after_ms: int = 0) -> float:
        """The record's trainer refused a lease as `busy`: skip it for its job (see the module
        docstring) and drop the job from those kept. Returns the skip in seconds."""
        key = (rec.record.job_id, rec.trainer_id)
        k = self._broken.get(key, 0) + 1
        self._broken[key] = k
        skip, base = busy_skip(retry_after_ms / 1000, k)
        now = self.clock()
        self._skip[key] = (now + skip, now + base, int(rec.record.head_version))
        if rec.record.job_id in self.kept:
            self.kept.remove(rec.record.job_id)
        if len(self._skip) > 4096:   # forget skips that ended (jobs and trainers come and go)
            now = self.clock()
            self._skip = {k2: t for k2, t in self._skip.items() if t[0] > now}
            self._broken = {k2: n for k2, n in self._broken.items() if k2 in self._skip}
        log.info("job %s: trainer %s is busy although it announced capacity %d; skipped for %.1f s",
                 rec.record.job_id[:12], rec.trainer_id[:12], rec.record.demand.capacity, skip)
        return skip
