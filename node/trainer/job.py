"""One job hosted by a trainer: leases, admission, GRPO steps, publishing and checkpoints.

The step reads like the walk in DESIGN.md: take a batch of admitted groups -> learner step ->
publish the new version as a signed delta -> mark the groups trained -> checkpoint.
With cotrainers (other trainers of the same job, `swarm.job_swarm`), the learner step averages
gradients with them, and `coordinate` adopts a cotrainer's state when it is ahead.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
from peft import PeftModel

from swarmrl.node.model_card import write_model_card
from swarmrl.node.models import encode_prompt, vocab_size
from swarmrl.node.swarm.cotrainers import Cotrainer, fetch_chain
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.swarm.trainer_state import SharedState, pack, priority
from swarmrl.node.trainer.adapter_store import AdapterStore, StoredUpdate
from swarmrl.node.trainer.bans import BanBook
from swarmrl.node.trainer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from swarmrl.node.trainer.learner import Learner
from swarmrl.node.trainer.leases import LeaseBook
from swarmrl.node.trainer.ledger import Ledger, PendingGroup
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.envs import get_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.updates import ReceivedUpdate
from swarmrl.protocol.verdicts import BAD_SIGNATURE_ON_OWN_LEASE, BAN_MS, BANNING_CHECKS, is_attributable

log = logging.getLogger(__name__)
STALE_AT_STEP = "stale_at_step"
BACKLOG_BATCHES = 2  # leases are refused ("busy") while this many batches are pending


def now_ms() -> int:
    return int(time.time() * 1000)


class JobRuntime:
    """Everything a trainer holds for one job. Thread-safe: gRPC threads admit and lease while
    the trainer's main loop calls `train_step`."""

    def __init__(
        self, job_id: str, spec: JobSpec, *, identity: Identity, model_path: Path, state_dir: Path, ledger: Ledger,
        prompt_shard: tuple[int, int] = (0, 1), probation_ms: int = 0,
    ) -> None:
        """probation_ms: how long the admitted groups of a peer without a passing verdict from a
        trusted validator wait before a step may use them (0: no probation; see `trainable_cutoff`)."""
        self.job_id, self.spec, self.identity, self.ledger = job_id, spec, identity, ledger
        self.probation_ms = probation_ms
        self.dir = state_dir / "jobs" / job_id
        self.env = get_environment(spec.environment, spec.env_version)
        self.learner = Learner(model_path, spec)
        self.store = AdapterStore(self.dir / "adapters", job_id, identity)
        self.leases = LeaseBook(job_id, ttl_ms=int(spec.lease_ttl_s * 1000), shard=prompt_shard)
        self.limits = adm.AdmissionLimits(
            group_size=spec.group_size, vocab_size=vocab_size(self.learner.model),
            max_prompt_tokens=spec.max_prompt_tokens, max_new_tokens=spec.sampling.max_new_tokens,
            reward_range=self.env.reward_range, num_reward_funcs=len(self.env.reward_funcs),
            max_async_level=spec.max_async_level,
        )
        self.bans = BanBook(job_id, ledger)
        self._prompt_ids: dict[int, list[int]] = {}
        self._lock = threading.RLock()
        self.version = 0
        self.head_hash = b""
        self.rejections_since_step = 0
        self.swarm: JobSwarm | None = None
        self.upload_bytes: Counter[str] = Counter()
        self._shared: SharedState | None = None
        self.published_at = 0.0
        self._resume()

    # ---- start-up
    def _resume(self) -> None:
        """Start fresh (publish version 0) or resume from the checkpoint plus later deltas."""
        ckpt = load_checkpoint(self.dir / "checkpoints")
        if ckpt is None:
            state = self.learner.state()
            self.head_hash = self.store.put_snapshot(0, state)
        else:
            state, step = ckpt.state, ckpt.step
            for v in range(step + 1, self.store.latest_version() + 1):
                update = self.store.delta(v)
                if update is None:
                    break
                state, step = ad.apply_delta(state, ad.decode_state(update.payload)), v
            self.learner.load_state(state)
            self.learner.load_optimizer_state(ckpt.optimizer)
            self.version = step
            self.head_hash = ad.adapter_hash(state)
            log.info("job %s resumed at version %d (checkpoint %d)", self.job_id, step, ckpt.step)
        self._head_state = state
        self.leases.restore(self.ledger.leases(self.job_id, open_only=True), self.ledger.admitted_indices(self.job_id))

    @property
    def banned(self) -> dict[str, str]:
        """peer -> reason of the job's bans (see `ban` and protocol.verdicts)."""
        return self.bans.banned

    @property
    def strikes(self) -> Counter[str]:
        """peer -> attributable admission failures (groups), durable."""
        return self.bans.strikes

    @property
    def done(self) -> bool:
        return self.version >= self.spec.steps

    def record(self, endpoint: str) -> pb.JobRecord:
        """The DHT record announcing this job."""
        return pb.JobRecord(
            job_id=self.job_id, trainer_id=self.identity.peer_id, endpoint=endpoint, base_model=self.spec.base_model,
            base_model_sha256=bytes.fromhex(self.spec.base_model_sha256), environment=self.spec.environment,
            env_version=self.spec.env_version, head_version=self.version, head_hash=self.head_hash,
            updated_ms=now_ms(), done=self.done, spec_json=self.spec.canonical_json(),
            trainer_public_key=self.identity.public_key,
            cotrainer_keys=[c.public_key for c in self.swarm.cotrainers.live()] if self.swarm else [],
        )

    # ---- leases
    def sampling(self) -> pb.SamplingParams:
        s = self.spec.sampling
        return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                 n=self.spec.group_size, stop=list(s.stop))

    def request_lease(self, peer_id: str, req: pb.LeaseRequest) -> pb.LeaseReply:
        """Grant a lease, or say why not."""
        self.expire_bans()
        if peer_id in self.banned:
            return pb.LeaseReply(reason=adm.BANNED)
        if self.done:
            return pb.LeaseReply(reason="job_done")
        self.expire_leases()
        if self.backlog() >= BACKLOG_BATCHES * self.spec.batch_groups:
            # Backpressure: more rollouts would only go stale before a step could use them.
            return pb.LeaseReply(reason="busy", retry_after_ms=1000)
        n = max(1, min(req.max_prompts or self.spec.prompts_per_lease, self.spec.prompts_per_lease))
        lease = self.leases.issue(peer_id, n, self.version, self.sampling(), now_ms())
        self.ledger.add_lease(lease)
        return pb.LeaseReply(lease=lease)

    def expire_leases(self) -> None:
        for lease_id in self.leases.expire(now_ms()):
            self.ledger.close_lease(lease_id)

    # ---- admission
    def prompt_ids(self, index: int) -> list[int]:
        """Token ids of prompt `index`, derived from (job seed, index)."""
        if index not in self._prompt_ids:
            text = self.env.prompt(self.spec.seed, index).text
            self._prompt_ids[index] = encode_prompt(self.learner.tokenizer, text)
        return self._prompt_ids[index]

    def admit(self, envelope: pb.Signed, max_bytes: int) -> pb.BatchReceipt:
        """Verify and admit one signed rollout batch; every refusal is counted with its reason."""
        batch_id = signing.envelope_id(envelope)
        signer = signing.signer_id(envelope) if len(envelope.public_key) == 32 else "unknown"
        if envelope.ByteSize() > max_bytes:
            return self._refuse(batch_id, signer, adm.OVERSIZED, 1)
        try:
            batch, signer = signing.open_signed(envelope, signing.ROLLOUT_BATCH, pb.RolloutBatch)
        except signing.SignatureError as exc:
            holder = self._private_lease_holder(envelope, signer)
            if holder:
                forged = pb.RolloutBatch.FromString(envelope.body)
                self._strike(holder, BAD_SIGNATURE_ON_OWN_LEASE, forged.lease_id, count=max(1, len(forged.groups)))
            return self._refuse(batch_id, signer, exc.reason, 1)
        self.expire_bans()
        lease = self.leases.get(batch.lease_id) or self.ledger.lease(batch.lease_id)
        reason = adm.check_batch_envelope(
            batch, signer, lease, now_ms=now_ms(), batch_seen=self.ledger.batch_seen(batch_id), banned=self.banned
        )
        if reason:
            if is_attributable(reason):
                self._strike(signer, reason, batch.lease_id, count=max(1, len(batch.groups)))
            return self._refuse(batch_id, signer, reason, max(1, len(batch.groups)))
        assert lease is not None
        return self._admit_groups(batch_id, envelope, batch, lease)

    def _admit_groups(self, batch_id: str, envelope: pb.Signed, batch: pb.RolloutBatch, lease: pb.Lease) -> pb.BatchReceipt:
        expected = {i: self.prompt_ids(i) for i in lease.prompt_indices}
        taken = self.ledger.admitted_indices(self.job_id) & set(expected)
        verdicts, admitted = [], []
        with self._lock:
            version = self.version
        for g in batch.groups:
            reason = adm.check_group(g, lease, current_version=version, expected_prompt_ids=expected,
                                     already_admitted=taken, lim=self.limits)
            verdicts.append(pb.GroupVerdict(prompt_index=g.prompt_index, admitted=not reason, reason=reason))
            if reason:
                self._count_rejection(signer=batch.peer_id, reason=reason)
            else:
                admitted.append(g)
                taken.add(g.prompt_index)
        self.ledger.admit(batch_id, batch, envelope, admitted, now_ms())  # durable before the receipt
        if admitted and self.leases.record_answers(lease.lease_id, [g.prompt_index for g in admitted]):
            self.ledger.close_lease(lease.lease_id)
        blamed = [v.reason for v in verdicts if is_attributable(v.reason)]
        if blamed:
            self._strike(batch.peer_id, blamed[-1], lease.lease_id, count=len(blamed))
        return pb.BatchReceipt(batch_id=batch_id, accepted=True, groups=verdicts)

    def _private_lease_holder(self, envelope: pb.Signed, named: str) -> str:
        """The peer a batch with a bad signature can be pinned on, or "": the body names an open
        lease of the very peer whose public key the envelope carries, and no batch answering that
        lease was recorded yet (SampleAdmitted never showed its id), so only that peer knew it."""
        try:
            lease_id = pb.RolloutBatch.FromString(envelope.body).lease_id
        except Exception:  # noqa: BLE001 - garbage: nothing to pin
            return ""
        lease = self.leases.get(lease_id)
        if lease is None or lease.peer_id != named or self.ledger.lease_exposed(lease_id):
            return ""
        return named

    # ---- bans (the record: bans.BanBook; the consequences: here)
    def _strike(self, peer_id: str, reason: str, lease_id: str = "", count: int = 1) -> None:
        """`count` attributable admission failures (provably wrong signed groups, or a forged
        batch on the peer's private lease); STRIKES_TO_BAN of them ban the peer. The peer's lease
        it answered is revoked (its prompts go back to the queue at once)."""
        self._revoke(self.leases.open_of(peer_id) if not lease_id else
                     [lease_id] if lease_id in self.leases.open_of(peer_id) else [])
        if self.bans.strike(peer_id, count):
            self.ban(peer_id, f"admission: {self.strikes[peer_id]} attributable failures, last {reason}")

    def ban(self, peer_id: str, reason: str, duration_ms: int = BAN_MS) -> int:
        """Ban `peer_id` from the job (no leases, batches refused), drop its untrained groups.
        Returns how many groups were dropped. Durable (ledger): a restart keeps the ban."""
        reason = self.bans.add(peer_id, reason, now_ms(), duration_ms)
        self._revoke(self.leases.open_of(peer_id))
        dropped = self.ledger.drop_peer(self.job_id, peer_id, note=f"banned: {reason}"[:200])
        log.warning("job %s: banned %s (%s), dropped %d groups", self.job_id, peer_id, reason, dropped)
        return dropped

    def _revoke(self, lease_ids: list[str]) -> None:
        for lease_id in self.leases.revoke(lease_ids):
            self.ledger.close_lease(lease_id)

    def lift_ban(self, peer_id: str) -> None:
        """End a ban now and clear the peer's strikes (its history stays in the ledger)."""
        self.bans.lift(peer_id)

    def expire_bans(self) -> None:
        self.bans.expire(now_ms())

    def _refuse(self, batch_id: str, signer: str, reason: str, groups: int) -> pb.BatchReceipt:
        self._count_rejection(signer=signer, reason=reason, count=groups)
        return pb.BatchReceipt(batch_id=batch_id, accepted=False, reason=reason)

    def _count_rejection(self, *, signer: str, reason: str, count: int = 1) -> None:
        self.ledger.reject(self.job_id, signer, reason, now_ms(), count)
        self.rejections_since_step += count

    # ---- training
    def ready(self) -> bool:
        """A full batch of trainable groups inside the staleness window is pending (older ones
        are dropped)."""
        if self.done:
            return False
        self.ledger.drop_stale(self.job_id, self.version - self.spec.max_async_level, note=STALE_AT_STEP)
        return self.ledger.count_pending(self.job_id, held_after_ms=self.trainable_cutoff()) >= self.spec.batch_groups

    def trainable_cutoff(self) -> int | None:
        """Probation: a group of a peer that no trusted validator has passed yet may be trained
        only once its batch is `probation_ms` old (unix ms cutoff; None: no probation). A new
        peer's first groups then wait for the validator, which checks new peers at rate 1, so a
        cheater is usually banned (and its groups dropped) before any of them is trained; the
        cutoff keeps a slow or absent validator from stalling the job."""
        return now_ms() - self.probation_ms if self.probation_ms > 0 else None

    def backlog(self) -> int:
        """Admitted groups not trained yet. Outstanding leases don't count: a peer that takes
        leases and never answers must not be able to starve the job of workers."""
        return self.ledger.count_pending(self.job_id)

    def groups_on_probation(self) -> int:
        """Pending groups a step may not use yet (their peer has no passing verdict; see
        `trainable_cutoff`)."""
        cutoff = self.trainable_cutoff()
        if cutoff is None:
            return 0
        return self.ledger.count_pending(self.job_id) - self.ledger.count_pending(self.job_id, held_after_ms=cutoff)

    def take_batch(self) -> list[PendingGroup]:
        """The next `batch_groups` trainable pending groups still inside the staleness window."""
        while True:
            pending = self.ledger.pending(self.job_id, self.spec.batch_groups, held_after_ms=self.trainable_cutoff())
            stale = [p for p in pending if self.version - min(c.policy_version for c in p.group.completions)
                     > self.spec.max_async_level]
            if not stale:
                return pending
            self.ledger.mark([p.row_id for p in stale], "dropped", note=STALE_AT_STEP)

    def train_step(self) -> dict[str, float] | None:
        """admit -> batch -> step -> publish -> checkpoint. Returns the step's metrics row, or
        None when an averaged step was abandoned (a cotrainer got ahead; see swarm.job_swarm)."""
        t0 = time.monotonic()
        batch = self.take_batch()
        metrics = self._learn([p.group for p in batch])
        if metrics is None:
            return None
        self.publish(self.learner.state())
        self.ledger.mark([p.row_id for p in batch], "trained", step=self.version)
        self.checkpoint()
        row = self._metrics_row(batch, metrics, time.monotonic() - t0)
        self.ledger.record_step(self.job_id, self.version, row)
        if self.done:
            self.export(self.dir / "final")
        return row

    def _learn(self, groups: list[pb.Group]) -> dict[str, float] | None:
        if self.swarm is None or self.swarm.averaging is None or not self.swarm.active:
            return self.learner.step(groups, self.version)
        return self.swarm.step(self.learner, groups, self.spec, self.version, self.head_hash)

    def publish(self, new_state: ad.State) -> None:
        """Sign and store the next version's delta; adopt the exact reconstructed state."""
        with self._lock:
            exact, update = self.store.publish(self.version + 1, self._head_state, new_state)
            self.learner.load_state(exact)
            self._head_state = exact
            self.version += 1
            self.head_hash = bytes(pb.AdapterUpdate.FromString(update.header.body).to_hash)
            self._keep_shared()
        self.published_at = time.time()

    # ---- cotrainers (several trainers of one job)
    def attach_swarm(self, swarm: JobSwarm) -> None:
        self.swarm = swarm

    def coordinate(self, records: list[VerifiedRecord]) -> None:
        """Multi-trainer housekeeping before a step: refresh the cotrainers; once there is one,
        share our state and adopt a cotrainer's when it is ahead or wins a split."""
        if self.swarm is None:
            return
        self.swarm.refresh(records)
        if not self.swarm.active:
            return
        if self._shared is None:
            with self._lock:
                self._keep_shared()
        self.swarm.share(self.learner.params, self._shared_state, priority(self.version, self.identity.peer_id))
        target = self.swarm.cotrainers.sync_target(self.version, self.head_hash)
        if target is not None and self.swarm.may_sync():
            self.sync_from(target)

    def cotrainer_ids(self) -> tuple[str, ...]:
        """The live cotrainers (the keys this trainer's record vouches for)."""
        return tuple(c.trainer_id for c in self.swarm.cotrainers.live()) if self.swarm is not None else ()

    def peer_round_open(self) -> bool:
        """True when a cotrainer is looking for an averaging group at our version (join it)."""
        return not self.done and self.swarm is not None and self.swarm.peer_round_open(self.version)

    def _keep_shared(self) -> None:
        if self.swarm is not None and self.swarm.active:
            self._shared = SharedState(self.job_id, self.identity.peer_id, self.version, self.head_hash,
                                       self._head_state, copy.deepcopy(self.learner.optimizer_state()))
            if self.swarm.averaging is not None:
                self.swarm.averaging.set_state(self._shared_state, priority(self.version, self.identity.peer_id))

    def _shared_state(self) -> tuple[dict, list]:
        with self._lock:
            shared = self._shared
        assert shared is not None
        return pack(shared, self.learner.params)

    def sync_from(self, target: Cotrainer) -> bool:
        """Adopt a cotrainer's state: adapter + optimizer from its shared state, the adapter
        checked against its signed updates (re-signed into our store). Returns whether it did."""
        assert self.swarm is not None
        shared = self.swarm.load_state(self.learner.params, self.learner.optimizer_state()["param_groups"])
        if shared is None or not (shared.version > self.version or
                                  (shared.version == self.version and shared.adapter_hash != self.head_hash)):
            return False
        source = self.swarm.cotrainers.get(shared.trainer_id) or target
        try:
            updates = fetch_chain(source, self.job_id, have_version=self.version, have_hash=self.head_hash,
                                  want_version=shared.version)
            self.adopt(updates, shared)
        except (grpc.RpcError, ad.AdapterError) as exc:
            log.warning("job %s: adopting the state of %s failed: %s", self.job_id[:12], source.trainer_id[:12], exc)
            return False
        log.info("job %s: adopted version %d (%s) from cotrainer %s", self.job_id[:12], self.version,
                 self.head_hash.hex()[:12], source.trainer_id[:12])
        return True

    def adopt(self, updates: list[ReceivedUpdate], shared: SharedState) -> None:
        """Apply a cotrainer's verified updates and its optimizer state; checkpoint.

        Raises:
            ad.AdapterError: the updates don't reproduce their signed hashes or the shared adapter.
        """
        assert self.swarm is not None
        with self._lock:
            state, states = self._head_state, []
            for u in updates:
                payload = ad.decode_state(u.payload)
                state = payload if u.header.snapshot else ad.apply_delta(state, payload)
                if ad.adapter_hash(state) != bytes(u.header.to_hash):
                    raise ad.AdapterError(f"version {u.header.to_version} does not reproduce its signed hash")
                states.append(state)
            if ad.adapter_hash(state) != shared.adapter_hash:
                raise ad.AdapterError("the cotrainer's signed updates do not reach its shared adapter")
            for u, after in zip(updates, states):
                self.store.adopt(u.header, u.payload, after)
            self.learner.load_state(state)
            self.learner.load_optimizer_state(shared.optimizer)
            self.version, self.head_hash, self._head_state = shared.version, shared.adapter_hash, state
            self._keep_shared()
        self.checkpoint()
        self.swarm.counters["state_syncs"] += 1
        if self.done:
            self.export(self.dir / "final")

    def count_upload(self, requester: str, n: int) -> None:
        with self._lock:
            self.upload_bytes[requester or "other"] += n

    def checkpoint(self) -> None:
        save_checkpoint(self.dir / "checkpoints",
                        Checkpoint(self.version, self._head_state, self.learner.optimizer_state()))

    def _metrics_row(self, batch: list[PendingGroup], metrics: dict[str, float], seconds: float) -> dict[str, float]:
        row = {"step": float(self.version), "policy_version": float(self.version),
               "groups_admitted": float(len(batch)), "groups_rejected": float(self.rejections_since_step),
               "seconds": seconds, "time": time.time(), "published_at": self.published_at}
        self.rejections_since_step = 0
        row.update(metrics)
        return row

    def export(self, out: Path) -> Path:
        """Write the head adapter in PEFT format (adapter_config.json + adapter_model.safetensors)."""
        model = self.learner.model
        assert isinstance(model, PeftModel)
        with self._lock:
            model.save_pretrained(str(out), save_embedding_layers=False)
        write_model_card(out, self.spec, self.job_id, self.version, self.ledger.steps(self.job_id))
        return out

    # ---- adapters
    def updates(self, req: pb.AdapterRequest) -> Iterator[StoredUpdate]:
        """Deltas from `have_version` to the wanted version, or one snapshot."""
        with self._lock:
            head = self.version
        return self.store.updates(req, head)

    # ---- verdicts
    def apply_verdicts(self, validator_id: str, report: pb.VerdictReport) -> list[str]:
        """Record verdicts; ban peers with a failed banning check. Returns the newly banned peers."""
        self.ledger.add_verdicts(self.job_id, validator_id, report.verdicts, now_ms())
        newly = []
        for v in report.verdicts:
            if not v.passed and v.check in BANNING_CHECKS and v.peer_id not in self.banned:
                self.ban(v.peer_id, f"{v.check}: {v.detail}")
                newly.append(v.peer_id)
        return newly

    # ---- status
    def status(self, history: int) -> pb.JobStatus:
        counts = self.ledger.group_counts(self.job_id)
        rejected = self.ledger.rejection_counts(self.job_id)
        checked, failed = self.ledger.verdict_counts(self.job_id)
        st = pb.JobStatus(
            job_id=self.job_id, state="done" if self.done else "running", policy_version=self.version,
            step=self.version, total_steps=self.spec.steps, adapter_hash=self.head_hash,
            groups_admitted=sum(counts.values()), groups_dropped=counts.get("dropped", 0),
            validator_checked=checked, validator_failed=failed, trainer_id=self.identity.peer_id,
            groups_dropped_banned=self.ledger.dropped_banned(self.job_id),
            groups_on_probation=self.groups_on_probation(),
            spec_json=self.spec.canonical_json(),
            adapter_bytes=sum(t.numel() * 4 for t in self._head_state.values()),
        )
        with self._lock:
            st.upload_bytes.update(self.upload_bytes)
        st.delta_bytes.extend(self.store.delta_sizes(self.version))
        if self.swarm is not None:
            self.swarm.fill_status(st)
        st.groups_rejected.update(rejected)
        st.peers.extend(self._peers())
        for row in self.ledger.steps(self.job_id)[-history:] if history else []:
            st.history.append(_step_metrics(row))
        return st

    def _peers(self) -> list[pb.PeerInfo]:
        """Per-peer figures; reputation = (passed + 1) / (verdicts + 2) over the verdicts received
        (the validator's Laplace score, without its soft flags)."""
        rejected = self.ledger.peer_rejections(self.job_id)
        states = self.ledger.peer_state_counts(self.job_id)
        admitted = {p: sum(by_state.values()) for p, by_state in states.items()}
        verdicts = self.ledger.peer_verdict_counts(self.job_id)
        first = self.ledger.peer_first_seen(self.job_id)
        ids = sorted((set(admitted) | set(rejected) | set(self.banned)) - {"unknown"})
        out = []
        for p in ids:
            checked, failed = verdicts.get(p, (0, 0))
            out.append(pb.PeerInfo(
                peer_id=p, groups_admitted=admitted.get(p, 0), groups_rejected=sum(rejected.get(p, {}).values()),
                reputation=(checked - failed + 1) / (checked + 2), banned=p in self.banned,
                ban_reason=self.banned.get(p, ""), banned_at_ms=self.bans.banned_at.get(p, 0), first_seen_ms=first.get(p, 0),
                groups_trained=states.get(p, {}).get("trained", 0), groups_dropped=states.get(p, {}).get("dropped", 0),
                rejected_by_reason=dict(rejected.get(p, {})), verdicts_checked=checked, verdicts_failed=failed,
                strikes=self.strikes.get(p, 0)))
        return out


CORE_FIELDS = ("step", "policy_version", "reward_mean", "groups_admitted", "groups_rejected", "staleness_mean",
               "loss", "seconds")


def _step_metrics(row: dict[str, float]) -> pb.StepMetrics:
    m = pb.StepMetrics(
        step=int(row["step"]), policy_version=int(row["policy_version"]), reward_mean=row["reward_mean"],
        groups_admitted=int(row["groups_admitted"]), groups_rejected=int(row["groups_rejected"]),
        staleness_mean=row["staleness_mean"], loss=row["loss"], seconds=row["seconds"],
    )
    m.extra.update({k: float(v) for k, v in row.items() if k not in CORE_FIELDS and not math.isnan(float(v))})
    return m
