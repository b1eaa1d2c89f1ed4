"""One job hosted by a trainer: leases, admission, GRPO steps, publishing and checkpoints.

The step reads like the walk in DESIGN.md: take a batch of admitted groups -> learner step ->
publish the new version as a signed delta -> mark the groups trained -> checkpoint.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from peft import PeftModel

from swarmrl.node.models import encode_prompt, vocab_size
from swarmrl.node.trainer.adapter_store import AdapterStore, StoredUpdate
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
from swarmrl.protocol.verdicts import BANNING_CHECKS

log = logging.getLogger(__name__)
STALE_AT_STEP = "stale_at_step"


def now_ms() -> int:
    return int(time.time() * 1000)


class JobRuntime:
    """Everything a trainer holds for one job. Thread-safe: gRPC threads admit and lease while
    the trainer's main loop calls `train_step`."""

    def __init__(
        self, job_id: str, spec: JobSpec, *, identity: Identity, model_path: Path, state_dir: Path, ledger: Ledger
    ) -> None:
        self.job_id, self.spec, self.identity, self.ledger = job_id, spec, identity, ledger
        self.dir = state_dir / "jobs" / job_id
        self.env = get_environment(spec.environment, spec.env_version)
        self.learner = Learner(model_path, spec)
        self.store = AdapterStore(self.dir / "adapters", job_id, identity)
        self.leases = LeaseBook(job_id, ttl_ms=int(spec.lease_ttl_s * 1000))
        self.limits = adm.AdmissionLimits(
            group_size=spec.group_size, vocab_size=vocab_size(self.learner.model),
            max_prompt_tokens=spec.max_prompt_tokens, max_new_tokens=spec.sampling.max_new_tokens,
            reward_range=self.env.reward_range, num_reward_funcs=len(self.env.reward_funcs),
            max_async_level=spec.max_async_level,
        )
        self.banned: dict[str, str] = {}
        self._prompt_ids: dict[int, list[int]] = {}
        self._lock = threading.RLock()
        self.version = 0
        self.head_hash = b""
        self.rejections_since_step = 0
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
        )

    # ---- leases
    def sampling(self) -> pb.SamplingParams:
        s = self.spec.sampling
        return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                                 n=self.spec.group_size, stop=list(s.stop))

    def request_lease(self, peer_id: str, req: pb.LeaseRequest) -> pb.LeaseReply:
        """Grant a lease, or say why not."""
        if peer_id in self.banned:
            return pb.LeaseReply(reason=adm.BANNED)
        if self.done:
            return pb.LeaseReply(reason="job_done")
        self.expire_leases()
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
            return self._refuse(batch_id, signer, exc.reason, 1)
        lease = self.leases.get(batch.lease_id) or self.ledger.lease(batch.lease_id)
        reason = adm.check_batch_envelope(
            batch, signer, lease, now_ms=now_ms(), batch_seen=self.ledger.batch_seen(batch_id), banned=self.banned
        )
        if reason:
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
        return pb.BatchReceipt(batch_id=batch_id, accepted=True, groups=verdicts)

    def _refuse(self, batch_id: str, signer: str, reason: str, groups: int) -> pb.BatchReceipt:
        self._count_rejection(signer=signer, reason=reason, count=groups)
        return pb.BatchReceipt(batch_id=batch_id, accepted=False, reason=reason)

    def _count_rejection(self, *, signer: str, reason: str, count: int = 1) -> None:
        self.ledger.reject(self.job_id, signer, reason, now_ms(), count)
        self.rejections_since_step += count

    # ---- training
    def ready(self) -> bool:
        return not self.done and self.ledger.count_pending(self.job_id) >= self.spec.batch_groups

    def take_batch(self) -> list[PendingGroup]:
        """The next `batch_groups` pending groups still inside the staleness window."""
        while True:
            pending = self.ledger.pending(self.job_id, self.spec.batch_groups)
            stale = [p for p in pending if self.version - min(c.policy_version for c in p.group.completions)
                     > self.spec.max_async_level]
            if not stale:
                return pending
            self.ledger.mark([p.row_id for p in stale], "dropped", note=STALE_AT_STEP)

    def train_step(self) -> dict[str, float]:
        """admit -> batch -> step -> publish -> checkpoint. Returns the step's metrics row."""
        t0 = time.monotonic()
        batch = self.take_batch()
        metrics = self.learner.step([p.group for p in batch], self.version)
        self.publish(self.learner.state())
        self.ledger.mark([p.row_id for p in batch], "trained", step=self.version)
        self.checkpoint()
        row = self._metrics_row(batch, metrics, time.monotonic() - t0)
        self.ledger.record_step(self.job_id, self.version, row)
        if self.done:
            self.export(self.dir / "final")
        return row

    def publish(self, new_state: ad.State) -> None:
        """Sign and store the next version's delta; adopt the exact reconstructed state."""
        with self._lock:
            exact, update = self.store.publish(self.version + 1, self._head_state, new_state)
            self.learner.load_state(exact)
            self._head_state = exact
            self.version += 1
            self.head_hash = bytes(pb.AdapterUpdate.FromString(update.header.body).to_hash)

    def checkpoint(self) -> None:
        save_checkpoint(self.dir / "checkpoints",
                        Checkpoint(self.version, self._head_state, self.learner.optimizer_state()))

    def _metrics_row(self, batch: list[PendingGroup], metrics: dict[str, float], seconds: float) -> dict[str, float]:
        row = {"step": float(self.version), "policy_version": float(self.version),
               "groups_admitted": float(len(batch)), "groups_rejected": float(self.rejections_since_step),
               "seconds": seconds, "time": time.time()}
        self.rejections_since_step = 0
        row.update(metrics)
        return row

    def export(self, out: Path) -> Path:
        """Write the head adapter in PEFT format (adapter_config.json + adapter_model.safetensors)."""
        model = self.learner.model
        assert isinstance(model, PeftModel)
        with self._lock:
            model.save_pretrained(str(out), save_embedding_layers=False)
        return out

    # ---- adapters
    def updates(self, req: pb.AdapterRequest) -> Iterator[StoredUpdate]:
        """Deltas from `have_version` to the wanted version, or one snapshot."""
        with self._lock:
            head = self.version
        want = req.want_version or head
        if want > head:
            return
        if req.snapshot or req.have_version > want:
            snap = self.store.snapshot(want)
            if snap is not None:
                yield snap
            return
        for v in range(req.have_version + 1, want + 1):
            update = self.store.delta(v)
            if update is None:
                return
            yield update

    # ---- verdicts
    def apply_verdicts(self, validator_id: str, report: pb.VerdictReport) -> list[str]:
        """Record verdicts; ban peers with a failed banning check. Returns the newly banned peers."""
        self.ledger.add_verdicts(self.job_id, validator_id, report.verdicts, now_ms())
        newly = []
        for v in report.verdicts:
            if not v.passed and v.check in BANNING_CHECKS and v.peer_id not in self.banned:
                self.banned[v.peer_id] = f"{v.check}: {v.detail}"[:200]
                dropped = self.ledger.drop_peer(self.job_id, v.peer_id, note=f"banned: {v.check}")
                log.warning("job %s: banned %s (%s), dropped %d groups", self.job_id, v.peer_id, v.check, dropped)
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
            spec_json=self.spec.canonical_json(),
        )
        st.groups_rejected.update(rejected)
        st.peers.extend(self._peers())
        for row in self.ledger.steps(self.job_id)[-history:] if history else []:
            st.history.append(_step_metrics(row))
        return st

    def _peers(self) -> list[pb.PeerInfo]:
        admitted = self.ledger.peer_group_counts(self.job_id)
        rejected = self.ledger.peer_rejection_counts(self.job_id)
        ids = sorted((set(admitted) | set(rejected) | set(self.banned)) - {"unknown"})
        return [pb.PeerInfo(peer_id=p, groups_admitted=admitted.get(p, 0), groups_rejected=rejected.get(p, 0),
                            banned=p in self.banned, ban_reason=self.banned.get(p, "")) for p in ids]


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
