"""One job's multi-trainer side inside a trainer: its cotrainers, the averaged step, shared state.

A `JobRuntime` with a `JobSwarm` behaves exactly as a lone trainer until a cotrainer shows up in
the DHT. From then on each optimizer step is one averaging round for the current version:

    begin matchmaking (group key = job + version) -> forward/backward -> put the gradient in
    (weight = admitted completion tokens; a non-finite gradient goes in as zeros with weight 0)
    -> the round agrees: step on the average (no step when no member had weight) | it does not:
    step on our own gradient, unless we had nothing to give or a cotrainer got ahead meanwhile
    (then abandon: the groups stay pending and we adopt the cotrainer's state instead).

A trainer that sees another one looking for a group at its version joins with whatever it has
(possibly nothing: weight 0), so trainers step in lockstep. Its state (adapter + AdamW) is shared
for cotrainers that fall behind (`swarm.trainer_state`).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import hivemind
import torch

from swarmrl.node.swarm.averaging import GradientAveraging
from swarmrl.node.swarm.cotrainers import Cotrainers
from swarmrl.node.swarm.dht import find_jobs
from swarmrl.node.swarm.trainer_state import SharedState, unpack
from swarmrl.node.trainer.learner import Learner, build_step_batch, summarize
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
SYNC_RETRY_S = 2.0
FAULTS = ("nan_gradients",)


class JobSwarm:
    """The cotrainers and the gradient averager of one job in one trainer (see module docstring).

    fault: "nan_gradients" makes this trainer a broken peer for drills: its gradients are NaN and
    it skips its own finiteness check (others must exclude it).
    """

    def __init__(self, dht: hivemind.DHT, my_id: str, job_id: str, *, allowed: set[str] | None = None,
                 matchmaking_s: float = 2.0, timeout_s: float = 60.0, fault: str | None = None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown trainer fault {fault!r}; known: {FAULTS}")
        self.dht, self.my_id, self.job_id = dht, my_id, job_id
        self.cotrainers = Cotrainers(job_id, my_id, allowed)
        self.matchmaking_s, self.timeout_s, self.fault = matchmaking_s, timeout_s, fault
        self.averaging: GradientAveraging | None = None
        self.counters: Counter[str] = Counter()
        self._last_sync = 0.0

    @property
    def active(self) -> bool:
        """True while at least one cotrainer is live."""
        return bool(self.cotrainers.live())

    def refresh(self, records: list | None = None) -> None:
        """Update the cotrainer view from the DHT's job records (read now when not given)."""
        self.cotrainers.update(find_jobs(self.dht) if records is None else records)

    def share(self, params: list[torch.Tensor], provider: Callable[[], tuple[Any, list[torch.Tensor]]],
              priority: float) -> None:
        """Start the averager (first time) and offer this trainer's state to cotrainers."""
        if self.averaging is None:
            logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)  # lonely rounds are normal
            self.averaging = GradientAveraging(self.dht, self.job_id, params, matchmaking_s=self.matchmaking_s,
                                               chunk_timeout_s=self.timeout_s / 2, allreduce_timeout_s=self.timeout_s)
            log.info("job %s: averaging gradients with %s", self.job_id[:12],
                     [c.trainer_id[:12] for c in self.cotrainers.live()])
        self.averaging.set_state(provider, priority)

    def peer_round_open(self, version: int) -> bool:
        return self.averaging is not None and self.active and self.averaging.peer_round_open(version)

    def may_sync(self) -> bool:
        """Rate limit for state downloads (at most one try every SYNC_RETRY_S)."""
        if time.monotonic() - self._last_sync < SYNC_RETRY_S:
            return False
        self._last_sync = time.monotonic()
        return True

    def load_state(self, params: list[torch.Tensor], param_groups: list[dict]) -> SharedState | None:
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

    def step(self, learner: Learner, groups: list[pb.Group], spec: JobSpec, version: int,
             head_hash: bytes) -> dict[str, float] | None:
        """One averaged GRPO step (module docstring). Returns the metrics row, or None when the
        step was abandoned (nothing was applied; the groups stay pending)."""
        assert self.averaging is not None
        t0 = time.monotonic()
        batch = build_step_batch(groups, spec, version)
        expected = 1 + len(self.cotrainers.live())
        pending = self.averaging.begin(version, {"version": version, "hash": head_hash.hex(), "trainer": self.my_id},
                                       expected=expected)
        loss, metrics = learner.compute_gradients(batch)
        if self.fault == "nan_gradients":
            learner.poison_gradients()
        finite = self.fault == "nan_gradients" or learner.gradients_finite()
        weight = float(batch.mask_BT.sum()) if finite else 0.0
        grads = learner.grads() if finite else [torch.zeros_like(p) for p in learner.params]
        outcome = self.averaging.finish(pending, grads, weight)
        if time.monotonic() - t0 > self.matchmaking_s + 5:
            log.info("job %s v%d: averaging round took %.1fs (%s)", self.job_id[:12], version,
                     time.monotonic() - t0, outcome.reason or "agreed")
        self.counters["averaging_excluded"] += len(outcome.excluded)
        if outcome.group_size < expected:
            self.cotrainers.probe(self.job_id)   # someone missed the round: is it still there?
        if outcome.agreed:
            if outcome.contributed:
                learner.set_grads(outcome.averaged or [])
            else:
                learner.clear_grads()      # nobody had a gradient: no optimizer step, at every member
            self.counters["averaging_rounds"] += 1
        else:
            self.counters["averaging_solo"] += 1
            if (not groups) or self._cotrainer_ahead(version):
                learner.clear_grads()
                log.info("job %s v%d: round %s; abandoning the step", self.job_id[:12], version, outcome.reason)
                return None
            if weight == 0.0 or not learner.gradients_finite():
                learner.clear_grads()
            log.info("job %s v%d: round %s; stepping on the local gradient", self.job_id[:12], version, outcome.reason)
        grad_norm = learner.apply_gradients()
        row = summarize(batch, loss, metrics, grad_norm, finite and not math.isnan(grad_norm), time.monotonic() - t0)
        row.update({"averaged_with": float(outcome.group_size - 1) if outcome.agreed else 0.0,
                    "grad_weight": weight, "excluded_peers": float(len(outcome.excluded))})
        return row

    def _cotrainer_ahead(self, version: int) -> bool:
        try:
            self.refresh()
        except Exception as exc:  # noqa: BLE001 - the DHT can fail: assume nobody is ahead
            log.warning("job %s: reading cotrainer records failed: %r", self.job_id[:12], exc)
        return any(c.head_version > version for c in self.cotrainers.live())

    def fill_status(self, st: pb.JobStatus) -> None:
        st.cotrainers.extend(c.trainer_id for c in self.cotrainers.live())
        st.averaging_rounds = self.counters["averaging_rounds"]
        st.averaging_solo = self.counters["averaging_solo"]
        st.averaging_excluded = self.counters["averaging_excluded"]
        st.state_syncs = self.counters["state_syncs"]

    def shutdown(self) -> None:
        if self.averaging is not None:
            self.averaging.shutdown()
