"""Several trainers of one job: share this trainer's state, and adopt a cotrainer's when it is
ahead or wins a split (its signed updates are verified and re-signed into our store).

The swarm layer (`node.swarm.job_swarm`) finds cotrainers and averages gradients; this file is
the trainer's side of it: what the job's head (version, hash, adapter, optimizer) becomes.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from swarmrl.node.swarm.cotrainers import Cotrainer, fetch_chain
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.swarm.trainer_state import SharedState, pack, priority
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import delta_codec as dc
from swarmrl.protocol import diloco
from swarmrl.protocol.updates import ReceivedUpdate

if TYPE_CHECKING:
    import torch

    from swarmrl.node.trainer.adapter_store import AdapterStore
    from swarmrl.node.trainer.learner import Learner
    from swarmrl.node.trainer.outer import OuterOptimizer
    from swarmrl.protocol.identity import Identity
    from swarmrl.protocol.jobspec import JobSpec

log = logging.getLogger(__name__)


class CotrainedJob(Protocol):
    """What cotraining reads and sets of a job's head (`trainer.job.JobRuntime` is one): its
    version, hash and tensors, the learner and store behind them, and the lock that guards them."""

    job_id: str
    identity: Identity
    dir: Path
    lock: threading.RLock
    learner: Learner
    store: AdapterStore
    version: int
    head_hash: bytes
    head_state: ad.State
    spec: JobSpec
    outer: OuterOptimizer | None

    @property
    def done(self) -> bool:
        """Whether the job has reached its steps."""

    def checkpoint(self) -> None:
        """Write the head (adapter, optimizer, step) atomically."""

    def export(self, out: Path) -> Path:
        """Export the head adapter in PEFT format into `out`."""


class CotrainerSync:
    """The multi-trainer side of one job (a `CotrainedJob`; its `swarm` is the job's `JobSwarm`)."""

    def __init__(self, job: CotrainedJob, swarm: JobSwarm) -> None:
        self.job, self.swarm = job, swarm
        self._shared: SharedState | None = None

    def coordinate(self, records: list[VerifiedRecord], split_winner: str = "") -> None:
        """Housekeeping before a step: refresh the cotrainers; once there is one, share our state
        (with DiLoCo, start the outer rounds' averager now, so a first round does not wait for it)
        and adopt a cotrainer's when it is ahead or wins a split (`split_winner`: the cotrainer
        that won a split a DiLoCo round found)."""
        job = self.job
        self.swarm.refresh(records)
        if not self.swarm.active:
            return
        if job.outer is not None:
            self.swarm.outer_rounds(job.learner.params, job.spec.outer_timeout_s, job.spec.outer_codec)
        if self._shared is None:
            with job.lock:
                self.keep_shared()
        if self._shared is None:   # DiLoCo before its outer state is stored: nothing to share yet
            return
        shared_version = self._shared.version
        self.swarm.share(job.learner.params, self._shared_state, priority(shared_version, job.identity.peer_id))
        target = self.swarm.cotrainers.sync_target(job.version, job.head_hash)
        if target is None and split_winner:
            target = self.swarm.cotrainers.get(split_winner)
        if target is not None and self.swarm.may_sync():
            self.sync_from(target)

    def cotrainer_ids(self) -> tuple[str, ...]:
        """The live cotrainers (the keys this trainer's record vouches for)."""
        return tuple(c.trainer_id for c in self.swarm.cotrainers.live())

    def peer_round_open(self) -> bool:
        """True when a cotrainer is looking for an averaging group at our version (join it)."""
        return not self.job.done and self.swarm.peer_round_open(self.job.version)

    def keep_shared(self) -> None:
        """Snapshot the head (adapter + optimizer) for cotrainers that fall behind; with DiLoCo
        the last outer version and the outer momentum (inner versions are this trainer's own).
        Call under the job's lock, after the head changed."""
        job = self.job
        if not self.swarm.active:
            return
        version, state, h, momentum = job.version, job.head_state, job.head_hash, None
        if job.outer is not None:
            version = diloco.last_outer_version(job.version, job.spec.inner_steps)
            if version != job.version:
                state = job.store.state_at(version) or {}
                h = ad.adapter_hash(state) if state else b""
            if not state:
                return
            momentum = [m.clone() for m in job.outer.momentum_P]
        self._shared = SharedState(job.job_id, job.identity.peer_id, version, h, state,
                                   copy.deepcopy(job.learner.optimizer_state()), momentum)
        if self.swarm.averaging is not None:
            self.swarm.averaging.set_state(self._shared_state, priority(version, job.identity.peer_id))

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self.job.lock:
            shared = self._shared
        assert shared is not None
        return pack(shared, self.job.learner.params)

    def sync_from(self, target: Cotrainer) -> bool:
        """Adopt a cotrainer's state: adapter + optimizer from its shared state, the adapter
        checked against its signed updates (re-signed into our store). Returns whether it did."""
        job = self.job
        shared = self.swarm.load_state(job.learner.params, job.learner.optimizer_state()["param_groups"])
        if shared is None or not (shared.version > job.version or
                                  (shared.version == job.version and shared.adapter_hash != job.head_hash)):
            log.info("job %s: cotrainer %s is at version %d, but no newer state came (%s)", job.job_id[:12],
                     target.trainer_id[:12], target.head_version,
                     "none" if shared is None else f"{shared.trainer_id[:12]}'s version {shared.version}")
            return False
        source = self.swarm.cotrainers.get(shared.trainer_id) or target
        try:
            updates = fetch_chain(source, job.job_id, have_version=job.version, have_hash=job.head_hash,
                                  want_version=shared.version, my_id=job.identity.peer_id)
            self.adopt(updates, shared)
        except (grpc.RpcError, ConnectionError, ad.AdapterError) as exc:   # ConnectionError: tls.PinError
            log.warning("job %s: adopting the state of %s failed: %s", job.job_id[:12], source.trainer_id[:12], exc)
            return False
        log.info("job %s: adopted version %d (%s) from cotrainer %s", job.job_id[:12], job.version,
                 job.head_hash.hex()[:12], source.trainer_id[:12])
        return True

    def adopt(self, updates: list[ReceivedUpdate], shared: SharedState) -> None:
        """Apply a cotrainer's verified updates and its optimizer state; checkpoint.

        Raises:
            ad.AdapterError: the updates don't reproduce their signed hashes or the shared adapter.
        """
        job = self.job
        with job.lock:
            state, states = job.head_state, []
            for u in updates:
                state = ad.decode_state(u.payload) if u.header.snapshot \
                    else ad.apply_delta(state, dc.decode_delta(u.payload))
                if ad.adapter_hash(state) != bytes(u.header.to_hash):
                    raise ad.AdapterError(f"version {u.header.to_version} does not reproduce its signed hash")
                states.append(state)
            if ad.adapter_hash(state) != shared.adapter_hash:
                raise ad.AdapterError("the cotrainer's signed updates do not reach its shared adapter")
            for u, after in zip(updates, states):
                job.store.adopt(u.header, u.payload, after)
            job.learner.load_state(state)
            job.learner.load_optimizer_state(shared.optimizer)
            if job.outer is not None:   # DiLoCo: the adopted version is an outer one; the next round starts there
                job.outer.reset([p.detach() for p in job.learner.params], shared.outer_momentum)
            job.version, job.head_hash, job.head_state = shared.version, shared.adapter_hash, state
            self.keep_shared()
        job.checkpoint()
        self.swarm.counters["state_syncs"] += 1
        if job.done:
            job.export(job.dir / "final")
