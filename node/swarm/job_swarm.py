"""One job's multi-trainer side inside a trainer: its cotrainers, the averaged step, shared state.

A trainer with a `JobSwarm` behaves exactly as a lone trainer until a cotrainer shows up in the
DHT. From then on each optimizer step is one averaging round for the current version, run by the
gradient reducer this file hands the trainer's step (`JobSwarm.reducer`; the swarm layer sees
tensors, never the learner):

    begin matchmaking (group key = job + version) -> forward/backward -> put the gradient in
    (weight = the loss's denominator, `LossNormalizer.denominator`; a non-finite gradient goes in
    as zeros with weight 0)
    -> the round agrees: step on the average (no step when no member had weight) | it does not:
    step on our own gradient, unless we had nothing to give or a cotrainer got ahead meanwhile
    (then abandon: the groups stay pending and we adopt the cotrainer's state instead).

A trainer that sees another one looking for a group at its version joins with whatever it has
(possibly nothing: weight 0), so trainers step in lockstep. Its state (adapter + AdamW) is shared
for cotrainers that fall behind (`swarm.trainer_state`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import hivemind
import torch

from swarmrl.node.swarm.averaging import AveragerStartFailed, GradientAveraging
from swarmrl.node.swarm.cotrainers import Cotrainers
from swarmrl.node.swarm.dht import VerifiedRecord, find_jobs
from swarmrl.node.swarm.outer_round import OuterRounds
from swarmrl.node.swarm.trainer_state import SharedState, unpack
from swarmrl.protocol.grpo.reduce import Reduced
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
SYNC_RETRY_S = 2.0
REFUSED = "refused:"   # counters' prefix of refused round members, by reason (`JobSwarm.count_refused`)


class JobSwarm:
    """The cotrainers and the gradient averager of one job in one trainer (see module docstring)."""

    def __init__(self, dht: hivemind.DHT, identity: Identity, job_id: str, *, allowed: set[str] | None = None,
                 matchmaking_s: float = 2.0, timeout_s: float = 60.0, sync: dict[str, Any] | None = None,
                 inner_steps: int | None = None) -> None:
        """identity: this trainer's key (it signs the tickets of its averaging rounds);
        allowed: the trainer ids it trains with (None: any trainer key);
        sync: the job's sync settings (`JobSpec.sync_settings`); a cotrainer whose record's
        spec differs in them is refused. inner_steps: DiLoCo's H (None: per-step averaging)."""
        self.dht, self.identity, self.my_id, self.job_id = dht, identity, identity.peer_id, job_id
        self.allowed = None if allowed is None else frozenset(allowed)
        self.cotrainers = Cotrainers(job_id, self.my_id, allowed, sync=sync, inner_steps=inner_steps)
        self.matchmaking_s, self.timeout_s = matchmaking_s, timeout_s
        self.averaging: GradientAveraging | None = None
        self.outer: OuterRounds | None = None
        self.counters: Counter[str] = Counter()
        self._last_sync = 0.0

    @property
    def active(self) -> bool:
        """True while at least one cotrainer is live."""
        return bool(self.cotrainers.live())

    def refresh(self, records: list[VerifiedRecord] | None = None) -> None:
        """Update the cotrainer view from the DHT's job records (read now when not given)."""
        self.cotrainers.update(find_jobs(self.dht) if records is None else records)

    def share(self, params: Sequence[torch.Tensor], provider: Callable[[], tuple[Any, list[torch.Tensor]]],
              priority: float) -> None:
        """Start the averager (first time) and offer this trainer's state to cotrainers. An
        averager that fails to start is counted (`averager_start_failed`) and tried again at the
        next call; meanwhile the trainer steps alone."""
        if self.averaging is None:
            logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)  # lonely rounds are normal
            try:
                self.averaging = GradientAveraging(self.dht, self.job_id, params, identity=self.identity,
                                                   allowed=self.allowed, matchmaking_s=self.matchmaking_s,
                                                   chunk_timeout_s=self.timeout_s / 2,
                                                   allreduce_timeout_s=self.timeout_s)
            except AveragerStartFailed as exc:
                self.counters["averager_start_failed"] += 1
                log.warning("job %s: %s; trying again at the next step", self.job_id[:12], exc)
                return
            log.info("job %s: averaging gradients with %s", self.job_id[:12],
                     [c.trainer_id[:12] for c in self.cotrainers.live()])
        self.averaging.set_state(provider, priority)

    def outer_rounds(self, params: Sequence[torch.Tensor], timeout_s: float, codec: str) -> OuterRounds | None:
        """DiLoCo's outer rounds of this job (started the first time; `node.swarm.outer_round`;
        `codec`: the job's `outer_codec`);
        None when their averager failed to start (counted; tried again next time: this outer
        step goes alone)."""
        if self.outer is None:
            try:
                self.outer = OuterRounds(self.dht, self.job_id, params, timeout_s=timeout_s, identity=self.identity,
                                         allowed=self.allowed, codec=codec)
            except AveragerStartFailed as exc:
                self.counters["averager_start_failed"] += 1
                log.warning("job %s: outer rounds: %s; this outer step goes alone", self.job_id[:12], exc)
                return None
            log.info("job %s: outer rounds with %s", self.job_id[:12], [c.trainer_id[:12] for c in self.cotrainers.live()])
        return self.outer

    def count_refused(self, refused: dict[str, str]) -> None:
        """Count the members a round left out, by reason (`refused_counts`)."""
        for why in refused.values():
            self.counters[REFUSED + why] += 1

    def refused_counts(self) -> dict[str, int]:
        """reason -> members left out of this job's averaging rounds, this run."""
        return {k.removeprefix(REFUSED): n for k, n in list(self.counters.items()) if k.startswith(REFUSED)}

    def peer_round_open(self, version: int) -> bool:
        """Whether a cotrainer has opened the averaging round of `version` (so this trainer should
        join it even without a full batch of its own)."""
        return self.averaging is not None and self.active and self.averaging.peer_round_open(version)

    def may_sync(self) -> bool:
        """Rate limit for state downloads (at most one try every SYNC_RETRY_S)."""
        if time.monotonic() - self._last_sync < SYNC_RETRY_S:
            return False
        self._last_sync = time.monotonic()
        return True

    def load_state(self, params: Sequence[torch.Tensor], param_groups: list[dict[str, Any]]) -> SharedState | None:
        """The state of the cotrainer with the highest sharing priority, checked for layout and
        adapter hash (None when none answered or it did not check)."""
        if self.averaging is None:
            return None
        t0 = time.monotonic()
        got = self.averaging.load_state(timeout_s=self.timeout_s)
        if time.monotonic() - t0 > 5:
            log.info("job %s: loading state from peers took %.1fs", self.job_id[:12], time.monotonic() - t0)
        if got is None:
            return None
        try:
            return unpack(got[0], got[1], params, param_groups)
        except ValueError as exc:
            log.warning("job %s: shared state refused: %s", self.job_id[:12], exc)
            return None

    @property
    def averaging_now(self) -> bool:
        """True when a step should be an averaging round (the averager runs and a cotrainer lives)."""
        return self.averaging is not None and self.active

    def reducer(self, version: int, head_hash: bytes, *, has_groups: bool) -> AveragingReduce:
        """The gradient reducer of one step at `version` (an averaging round; module docstring).

        has_groups: whether this trainer has groups of its own to step on (without any, a failed
        round abandons the step instead of stepping alone on nothing).
        """
        assert self.averaging is not None
        return AveragingReduce(self, version, head_hash, has_groups)

    def cotrainer_ahead(self, version: int) -> bool:
        """Whether a live cotrainer announces a version past `version` (re-reads the DHT)."""
        try:
            self.refresh()
        except Exception as exc:  # noqa: BLE001 - the DHT can fail: assume nobody is ahead
            log.warning("job %s: reading cotrainer records failed: %r", self.job_id[:12], exc)
        return any(c.head_version > version for c in self.cotrainers.live())

    def fill_status(self, st: pb.JobStatus) -> None:
        """Add the live cotrainers' peer ids and the averaging counters to a job's status."""
        st.cotrainers.extend(c.trainer_id for c in self.cotrainers.live())
        st.averaging_rounds = self.counters["averaging_rounds"]
        st.averaging_solo = self.counters["averaging_solo"]
        st.averaging_excluded = self.counters["averaging_excluded"]
        st.state_syncs = self.counters["state_syncs"]
        st.sync_bytes_sent = self.counters["averaging_bytes_sent"] + self.counters["outer_bytes_sent"]
        st.outer_rounds = self.counters["outer_rounds"] - self.counters["outer_solo"]
        st.averaging_refused.update(self.refused_counts())

    def shutdown(self) -> None:
        """Stop the gradient averager and the outer rounds' averager, where started."""
        if self.averaging is not None:
            self.averaging.shutdown()
        if self.outer is not None:
            self.outer.shutdown()


class AveragingReduce:
    """One averaging round as a gradient reducer (`protocol.grpo.reduce.GradientReducer`).

    begin: start matchmaking (group key = job + version), overlapping the forward/backward pass.
    reduce: put the gradient in (weight = the loss's denominator: tokens or completions by variant;
    weight 0 with zeros when the trainer has nothing usable); the round agrees: step on the average, or no step when no member
    had weight | it does not: step on the local gradient, unless there is none or the trainer had
    no groups or a cotrainer got ahead (then abandon).
    """

    def __init__(self, swarm: JobSwarm, version: int, head_hash: bytes, has_groups: bool) -> None:
        self.swarm, self.version, self.head_hash, self.has_groups = swarm, version, head_hash, has_groups
        self.expected = 1 + len(swarm.cotrainers.live())
        self.t0 = time.monotonic()
        self.pending: Any = None

    def begin(self) -> None:
        """Open the round (matchmaking runs in the averager's background)."""
        assert self.swarm.averaging is not None
        self.t0 = time.monotonic()
        self.pending = self.swarm.averaging.begin(
            self.version, {"version": self.version, "hash": self.head_hash.hex(), "trainer": self.swarm.my_id},
            expected=self.expected)

    def reduce(self, grads: list[torch.Tensor], weight: float) -> Reduced:
        """Average `grads` (one per LoRA parameter) with the round's members; see the class docstring."""
        swarm, version = self.swarm, self.version
        assert swarm.averaging is not None
        if self.pending is None:
            self.begin()
        t_in = time.monotonic()
        outcome = swarm.averaging.finish(self.pending, grads, weight)
        waited = time.monotonic() - t_in
        if time.monotonic() - self.t0 > swarm.matchmaking_s + 5:
            log.info("job %s v%d: averaging round took %.1fs (%s)", swarm.job_id[:12], version,
                     time.monotonic() - self.t0, outcome.reason or "agreed")
        swarm.counters["averaging_excluded"] += len(outcome.excluded)
        swarm.counters["averaging_bytes_sent"] += outcome.bytes_sent
        swarm.count_refused(outcome.refused)
        if outcome.group_size < self.expected:
            swarm.cotrainers.probe(swarm.job_id)   # someone missed the round: is it still there?
        metrics = {"averaged_with": float(outcome.group_size - 1) if outcome.agreed else 0.0,
                   "excluded_peers": float(len(outcome.excluded)), "averaging_bytes_sent": float(outcome.bytes_sent),
                   "averaging_seconds": waited}
        if outcome.agreed:
            swarm.counters["averaging_rounds"] += 1
            # nobody had a gradient: no optimizer step, at every member
            return Reduced(list(outcome.averaged or []) if outcome.contributed else None, metrics=metrics)
        swarm.counters["averaging_solo"] += 1
        if not self.has_groups or swarm.cotrainer_ahead(version):
            log.info("job %s v%d: round %s; abandoning the step", swarm.job_id[:12], version, outcome.reason)
            return Reduced(None, abandon=True, metrics=metrics)
        log.info("job %s v%d: round %s; stepping on the local gradient", swarm.job_id[:12], version, outcome.reason)
        return Reduced(grads if weight > 0 else None, metrics=metrics)
