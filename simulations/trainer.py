"""A trainer on the simulated clock: the real lease book and admission checks, a pending pool, bans.

What runs for real: `protocol.leases.LeaseBook` (issue, expire, revoke, re-issue; times injected),
the lease rule (`protocol.demand.open_capacity`, the product's promise: a lease of at most the open
capacity, "busy" at 0; or, under the scenario's `lease_rule = "pending"`, the rule before it,
`leases.backlog_full` over pending groups), `protocol.admission`'s batch and group checks on stand-in
protobufs, `verdicts.is_attributable` / `STRIKES_TO_BAN` for strikes, probation as the trainer's
`trainable_cutoff` reads it, and the staleness window at admission and at the step. What is not:
the ledger (a deque), signatures (a mode flag says a batch's signature is forged) and the model.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

from swarmrl.protocol import admission as adm
from swarmrl.protocol import red_team_modes as modes
from swarmrl.protocol.demand import open_capacity
from swarmrl.protocol.leases import LeaseBook, backlog_full
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import BAD_SIGNATURE_ON_OWN_LEASE, STRIKES_TO_BAN, is_attributable
from swarmrl.simulations import cheaters as ch
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.network import Uplink
from swarmrl.simulations.pending import Pending, PendingPool
from swarmrl.simulations.population import Worker
from swarmrl.simulations.scenario import JobShape

EXPIRE_EVERY_MS = 1000   # the product expires leases on every lease request; once a second here
JOB_ID = "sim-job"


class SimTrainer:
    """One trainer of the job (prompt shard `rank` of `count`)."""

    def __init__(self, rank: int, count: int, job: JobShape, uplink: Uplink, metrics: Metrics,
                 probation_s: float, last_chance: bool = True, job_id: str = JOB_ID) -> None:
        self.rank, self.job, self.uplink, self.m, self.job_id = rank, job, uplink, metrics, job_id
        ids = itertools.count()   # lease ids "rank-n": unique per job, reproducible from the seed
        self.book = LeaseBook(job_id, ttl_ms=int(job.lease_ttl_s * 1000), shard=(rank, count),
                              new_lease_id=lambda: f"{rank}-{next(ids)}")
        self.spec = job.spec()
        self.lim = ch.limits(job.max_async_level)
        self.sampling = pb.SamplingParams(n=job.group_size)
        self.pending = PendingPool(probation_s, last_chance)
        self.strikes: Counter[str] = Counter()
        self.banned: set[str] = set()
        self.exposed: set[str] = set()      # leases with a batch recorded (SampleAdmitted shows them)
        self.issued: Counter[int] = Counter()
        self.alive = True
        self.probation_s = probation_s
        self._expired_ms = -math.inf
        self.now_s = 0.0
        self.training = 0   # groups of the step in progress: pending in the product's ledger until published

    # ---- leases
    def request_lease(self, w: Worker, now_s: float, version: int, done: bool) -> tuple[str, pb.Lease | None]:
        """("lease", lease) or a refusal: "banned", "job_done", "busy" (as admission.request_lease)."""
        now = int(now_s * 1000)
        if w.peer_id in self.banned:
            return adm.BANNED, None
        if done:
            return "job_done", None
        self.expire(now)
        capacity = self.capacity()
        if capacity == 0:
            self.m.count("busy_refusals")
            return "busy", None
        lease = self.book.issue(w.peer_id, min(self.job.prompts_per_lease, capacity), version, self.sampling, now)
        self.issued.update(lease.prompt_indices)
        self.m.count("leases_issued")
        return "lease", lease

    def capacity(self) -> int:
        """Prompts this trainer leases now (0: "busy"). Under `lease_rule` "capacity" the
        product's promise, `protocol.demand.open_capacity`: `(max_async_level + 1) * batch_max`
        less the pending groups and the unanswered prompts of open leases. Under "pending" the
        rule before it, `leases.backlog_full`: a whole lease until the pending groups (plus, under
        the what-if `backlog_counts_open`, open leases' prompts) fill `backlog_batches` batches."""
        if self.job.lease_rule == "capacity":
            # The product's ledger marks a batch trained only after its version is published
            # (JobRuntime.train_step), so the step in progress still counts against the promise.
            return open_capacity(self.spec, len(self.pending) + self.training, self.book.open_prompts())
        open_prompts = self.book.open_prompts() if self.job.backlog_counts_open else 0
        full = backlog_full(len(self.pending), self.job.batch_groups, open_prompts=open_prompts,
                            batches=self.job.backlog_batches)
        return 0 if full else self.job.prompts_per_lease

    def busy(self) -> bool:
        """True when a lease request now would be refused as "busy" (`capacity` is 0)."""
        return self.capacity() == 0

    def expire(self, now_ms: int) -> None:
        """Expire overdue leases at `now_ms` (ms), at most once per EXPIRE_EVERY_MS."""
        if now_ms - self._expired_ms < EXPIRE_EVERY_MS:
            return
        self._expired_ms = now_ms
        self.m.count("leases_expired", len(self.book.expire(now_ms)))

    # ---- admission
    def submit(self, w: Worker, lease: pb.Lease, now_s: float, version: int) -> list[Pending]:
        """Admit (or refuse) the batch `w` returns for `lease`; returns the admitted groups."""
        now, self.now_s = int(now_s * 1000), now_s
        n = len(lease.prompt_indices)
        self.m.count("groups_generated", n)
        if w.mode == modes.FORGED_SIGNATURE:
            return self._forged(w, lease, n)
        if w.mode == modes.REPLAY:
            return self._replay(w, lease, now, version)
        reason = ch.batch_reason(w.peer_id, self.book.get(lease.lease_id), self.job_id, now_ms=now, seen=False,
                                 banned=self.banned)
        if reason:
            return self._refuse(w, lease, reason, n)
        self.exposed.add(lease.lease_id)
        admitted, indices = [], []
        for index in lease.prompt_indices:
            reason = ch.group_reason(w.mode, lease, index, version, self.lim)
            if reason:
                self._refuse(w, lease, reason, 1)
                continue
            indices.append(index)
            admitted.append(Pending(w, lease.policy_version, now_s))
        self.book.record_answers(lease.lease_id, indices)
        self.pending.add(admitted, now_s)
        self.m.count("groups_admitted", len(admitted))
        self.m.ingest(now_s, len(admitted))
        return admitted

    def _forged(self, w: Worker, lease: pb.Lease, n: int) -> list[Pending]:
        if self.book.get(lease.lease_id) is not None and lease.lease_id not in self.exposed:
            self._strike(w, BAD_SIGNATURE_ON_OWN_LEASE, lease, n)
        self.m.reject(adm.BAD_SIGNATURE, n)
        return []

    def _replay(self, w: Worker, lease: pb.Lease, now: int, version: int) -> list[Pending]:
        """An earlier admitted batch verbatim (replay, no blame), then earlier groups re-signed under
        its own lease (not in the lease: signed, so one strike each)."""
        self.m.reject(ch.batch_reason(w.peer_id, lease, self.job_id, now_ms=now, seen=True, banned=self.banned), 1)
        foreign = max(lease.prompt_indices) + 10**9
        reason = ch.group_reason(w.mode, lease, foreign, version, self.lim)
        self._refuse(w, lease, reason, ch.REPLAY_GROUPS)
        self.m.count("groups_generated", ch.REPLAY_GROUPS - len(lease.prompt_indices))
        return []

    def _refuse(self, w: Worker, lease: pb.Lease, reason: str, n: int) -> list[Pending]:
        self.m.reject(reason, n)
        if is_attributable(reason):
            self._strike(w, reason, lease, n)
        return []

    def _strike(self, w: Worker, reason: str, lease: pb.Lease, n: int) -> None:
        """One strike per provably wrong group; the batch's lease is revoked; STRIKES_TO_BAN ban."""
        self.strikes[w.peer_id] += n
        self.book.revoke([lease.lease_id])
        if self.strikes[w.peer_id] >= STRIKES_TO_BAN and w.peer_id not in self.banned:
            self.m.ban_reason(w, f"admission:{reason}")
            w.banned_s = min(w.banned_s, self.now_s)
            self.m.waste("banned", self.ban(w))

    def ban(self, w: Worker) -> int:
        """Ban the peer here: revoke its open leases, drop its untrained groups; returns how many."""
        self.banned.add(w.peer_id)
        self.book.revoke(self.book.open_of(w.peer_id))
        return self.pending.drop(lambda p: p.peer is w)

    # ---- steps
    def drop_stale(self, version: int) -> None:
        """Drop pending groups outside the staleness window of `version` (ledger.drop_stale at a step)."""
        floor = version - self.job.max_async_level
        self.m.waste("stale", self.pending.drop(lambda p: p.version < floor))

    def has_batch(self, now_s: float, version: int) -> bool:
        """True when a full batch of admitted groups is trainable at `now_s` (s) by a step from
        `version`: past probation (the peer passed a check, the group is `probation_s` old, or
        it is at its last chance; job.trainable_cutoff)."""
        least = self.spec.batch_min
        return len(self.pending) >= least and self.pending.trainable(now_s, version - self.job.max_async_level) >= least

    def take_batch(self, now_s: float, version: int, joining: bool = False) -> list[Pending]:
        """Take the next batch (the oldest trainable groups, at most `batch_max`, or none short of
        `batch_min`: elastic intake, `JobRuntime.take_batch`) off the pending pool; they count as
        `training` until `published`. `joining`: this trainer joins a cotrainer's round, so it
        takes what is trainable however few (the product's `TrainerNode.step` on `peer_round_open`)."""
        if not joining and not self.has_batch(now_s, version):
            return []
        batch = self.pending.take(self.spec.batch_max, now_s, version - self.job.max_async_level)
        self.training += len(batch)
        return batch

    def published(self) -> None:
        """The step in progress published its version: its groups are trained (they stop
        counting against the promise, as the ledger marks them "trained" then)."""
        self.training = 0

    def die(self) -> int:
        """The trainer is gone: its pending groups and open leases are lost; returns the groups."""
        self.alive = False
        return self.pending.clear()
