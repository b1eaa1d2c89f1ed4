"""A job's demand: what its trainer promises it can still use, signed into the job record.

Three numbers (`pb.Demand`, in `pb.JobRecord.demand`):
- capacity: prompts the trainer can lease now and still train on before they go stale. A prompt
  leased at version V may be trained by the steps at versions V .. V + max_async_level, each
  taking at most `batch_max` groups, oldest first; the groups already pending and the prompts
  still out on open leases are ahead of it. So the window is `(max_async_level + 1) * batch_max`
  groups and capacity = window - pending - open prompts (never below 0). Open leases count
  against the backlog, so a trainer never hands out work that would arrive stale; it refuses a
  lease beyond this promise as `busy` and grants at most `capacity` prompts.
- intake_per_min: groups the job consumed (trained into versions, or consumed without signal) in
  the last `INTAKE_WINDOW_S`, per minute.
- weight: the job's weight (`JobSpec.weight`, at most the trainer's cap for its submitter), its
  share of the swarm when demand exceeds supply (`protocol.market`).

Pure (no network, no clock of its own): the trainer (`node/trainer/admission.py`, `job.py`), the
worker (`node/worker/market.py`) and the simulator use the same rules. `check_demand` is what a
worker requires of a record before it follows it.
"""

from __future__ import annotations

import math
from collections import deque

from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import MAX_WEIGHT
from swarmrl.protocol.pb import swarm_pb2 as pb

INTAKE_WINDOW_S = 60.0   # the intake rate is measured over this many seconds
MAX_INTAKE_PER_MIN = 1e6   # groups per minute no trainer reaches (~16,700 per second): above it a record is absurd


def window_groups(spec: JobSpec) -> int:
    """The lease book's bound: groups the steps from the current version can train before a
    prompt leased now goes stale, `(max_async_level + 1) * batch_max`."""
    return (spec.max_async_level + 1) * spec.batch_max


def open_capacity(spec: JobSpec, pending_groups: int, open_prompts: int) -> int:
    """Prompts a trainer can lease now (>= 0): its window less `pending_groups` (admitted, not
    trained) and `open_prompts` (leased, not answered yet; one group each)."""
    return max(0, window_groups(spec) - pending_groups - open_prompts)


class IntakeMeter:
    """Groups consumed per minute over the last `window_s` seconds (times are arguments, in
    seconds on one clock that never jumps; not thread-safe: the trainer's step loop owns it)."""

    def __init__(self, window_s: float = INTAKE_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"intake window {window_s} s must be > 0")
        self.window_s = window_s
        self._steps: deque[tuple[float, int]] = deque()   # (time s, groups consumed) of recent steps

    def add(self, now_s: float, groups: int) -> None:
        """Count `groups` consumed by a step at `now_s`."""
        self._steps.append((now_s, groups))
        self._forget(now_s)

    def per_minute(self, now_s: float) -> float:
        """Groups consumed in (now_s - window_s, now_s], per minute."""
        self._forget(now_s)
        return sum(g for _, g in self._steps) * 60.0 / self.window_s

    def _forget(self, now_s: float) -> None:
        while self._steps and self._steps[0][0] <= now_s - self.window_s:
            self._steps.popleft()


def demand(capacity: int, intake_per_min: float, weight: float) -> pb.Demand:
    """The record's demand message."""
    return pb.Demand(capacity=capacity, intake_per_min=intake_per_min, weight=weight)


def check_demand(record: pb.JobRecord, spec: JobSpec, max_weight: float = MAX_WEIGHT) -> str:
    """Why a worker must ignore the record's demand ("" when it is sound): missing; capacity
    negative or above the lease book's bound (`window_groups`); intake negative, non-finite or
    above `MAX_INTAKE_PER_MIN`; weight not > 0, above the job's own (`spec.weight`: a trainer may
    cap it, never raise it) or above `max_weight` (the worker's cap)."""
    if not record.HasField("demand"):
        return "the record carries no demand (capacity, intake, weight)"
    d = record.demand
    bound = window_groups(spec)
    if d.capacity < 0:
        return f"capacity {d.capacity} is negative"
    if d.capacity > bound:
        return (f"capacity {d.capacity} is above the lease book's bound {bound} "
                f"((max_async_level + 1) x batch_max)")
    if not (math.isfinite(d.intake_per_min) and 0 <= d.intake_per_min <= MAX_INTAKE_PER_MIN):
        return f"intake {d.intake_per_min} groups/min is not in [0, {MAX_INTAKE_PER_MIN:g}]"
    if not (math.isfinite(d.weight) and d.weight > 0):
        return f"weight {d.weight} is not a positive number"
    if d.weight > spec.weight:
        return f"weight {d.weight:g} is above the job's own weight {spec.weight:g}"
    if d.weight > max_weight:
        return f"weight {d.weight:g} is above the cap {max_weight:g}"
    return ""
