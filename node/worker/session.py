"""One worker's work on one job: lease -> catch up -> generate -> grade -> sign -> submit.

A session follows one of the job's trainers (its signed DHT record), through the client it is
handed (`node.net.trainer_client.WorkerTrainer`: gRPC or in process); `use_record` switches to
another trainer of the same job (same adapter versions: they average gradients). Catch-up goes
through `swarm.catchup.CatchUp` (peers first, the trainer as fallback); the backend's adapter is
swapped only between rounds, so every completion carries the version that generated it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import hivemind

from swarmrl.node.inference.base import GenerateRequest, InferenceBackend, SampledCompletion, Sampling
from swarmrl.node.models.base_model import default_cache_dir
from swarmrl.node.models.causal_lm import render_prompt
from swarmrl.node.net.trainer_client import WorkerTrainer
from swarmrl.node.swarm.catchup import CatchUp
from swarmrl.node.swarm.datasets import DatasetFetchStats, DatasetStore, fetch_dataset
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.node.tasks.episode_play import grade_rows
from swarmrl.node.tasks.job_file import grader_for
from swarmrl.node.worker.engine import with_recovery
from swarmrl.node.worker.episodes import episode_groups
from swarmrl.node.worker.receipts import ReceiptStore
from swarmrl.node.worker.stats import SessionStats
from swarmrl.protocol import delta_sources, signing, snapshot_sources
from swarmrl.protocol.envs import PromptSpec, job_environment
from swarmrl.protocol.envs.episode import EpisodeEnv
from swarmrl.protocol.identity import Identity, peer_id_from_public_key
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.market import follows
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.receipts import ReceiptError, verify_receipt
from swarmrl.protocol.updates import AdapterReplica

log = logging.getLogger(__name__)
MAX_GAP = 8  # versions behind past which a snapshot is cheaper than the delta chain


class AdapterBehind(RuntimeError):
    """No source could serve the adapter version a lease asks for yet (e.g. the followed trainer
    is still syncing with its cotrainers); the round is retried."""


@dataclass
class RoundResult:
    """What one lease round produced (for logs and tests)."""

    lease_id: str
    policy_version: int
    groups: int
    admitted: int
    reasons: list[str]


class JobSession:
    """A worker's work on one job: the trainer it follows, its adapter replica and grading pool.

    trainer: the client of the followed trainer (`node.net.trainer_client.WorkerTrainer`: over
        gRPC, `grpc_wire.connect(record, ...)`, or in process, `node.local.inprocess`); the
        session closes it.
    receipts: where the trainer's verified signed receipts are kept (the worker's credit); None
        keeps none (they are still verified and counted).
    """

    def __init__(self, record: pb.JobRecord, trainer: WorkerTrainer, *, identity: Identity, backend: InferenceBackend,
                 max_prompts: int, grade_timeout_s: float, gossip: GossipNode | None = None,
                 dht: hivemind.DHT | None = None, max_gap: int = MAX_GAP, peer_wait_s: float = 1.0,
                 max_peer_attempts: int = delta_sources.MAX_PEER_ATTEMPTS, wait_rule: str = delta_sources.WAIT_RULE,
                 snapshot_rule: str = snapshot_sources.SNAPSHOT_RULE,
                 datasets: DatasetStore | None = None, dataset_stats: DatasetFetchStats | None = None,
                 receipts: ReceiptStore | None = None) -> None:
        self.spec = JobSpec.from_json(record.spec_json)
        self.receipts = receipts
        self.identity, self.backend, self.max_prompts = identity, backend, max_prompts
        self.record, self.trainer = record, trainer
        dataset = None
        if self.spec.dataset is not None:   # by content address: cache, peers, then this trainer
            dataset = fetch_dataset(self.spec.dataset, datasets or DatasetStore(default_cache_dir() / "datasets"),
                                    trainer=trainer, gossip=gossip, dht=dht, stats=dataset_stats,
                                    trainer_name=record.trainer_id)
        self.env = job_environment(self.spec, dataset)
        self.replica = AdapterReplica(record.job_id, bytes(record.trainer_public_key))
        self.sync = CatchUp(self.replica, trainer=trainer, signers=self.signers, gossip=gossip, dht=dht,
                            max_gap=max_gap, peer_wait_s=peer_wait_s, max_peer_attempts=max_peer_attempts,
                            wait_rule=wait_rule, snapshot_rule=snapshot_rule)
        self.loaded_version = -1   # the version the backend generates with
        self.loaded_hash = b""     # its adapter hash (stamped on every completion: content-addressed)
        self.grader = grader_for(self.spec, grade_timeout_s)
        self.stats = SessionStats()
        self.last_refusal, self.last_retry_ms = "", 0   # the trainer's last lease refusal: reason, retry hint
        self.chosen_s = time.monotonic()   # when a round last chose this job (prefetch follows it a while)

    def signers(self) -> set[str]:
        """Trainer ids whose signed updates this session accepts: the followed trainer and the
        cotrainers its record lists; with DiLoCo the followed trainer alone, since between outer
        steps each trainer publishes its own inner versions under the same numbers, and a batch
        sampled with a cotrainer's would be refused (`adapter_unknown`) by the trainer it goes to."""
        rec = self.record
        followed = peer_id_from_public_key(bytes(rec.trainer_public_key))
        if self.spec.diloco:
            return {followed}
        return {followed, *(peer_id_from_public_key(bytes(k)) for k in rec.cotrainer_keys if len(k) == 32)}

    def use_record(self, record: pb.JobRecord, trainer: WorkerTrainer | None = None) -> None:
        """Follow `record` (a newer record of the same trainer, or another trainer of the job);
        `trainer`: the client of the trainer it names, when that is not the one followed now
        (the old client is closed)."""
        assert record.job_id == self.record.job_id
        if trainer is not None and trainer is not self.trainer:
            old, self.trainer = self.trainer, trainer
            self.sync.trainer = trainer
            old.close()
            log.info("job %s: now following trainer %s at %s", self.job_id[:12], record.trainer_id[:12], record.endpoint)
            if self.spec.diloco and self.replica.version % self.spec.inner_steps:   # the old trainer's own
                self.sync.forget()                                                   # inner version
                self.loaded_version, self.loaded_hash = -1, b""
        self.record = record

    @property
    def job_id(self) -> str:
        """The followed job's id."""
        return self.record.job_id

    def close(self) -> None:
        """Stop the grading pool, close the trainer client and free the job's adapter slot."""
        self.grader.close()
        self.trainer.close()
        self.backend.remove_adapter(self.job_id)

    # ---- the round
    def work_once(self) -> RoundResult | None:
        """One lease, end to end. Returns None when the trainer granted no lease."""
        self.catch_up_to_head()
        lease = self.request_lease()
        if lease is None:
            return None
        prompts = self.prepare(lease)
        groups = self.generate(prompts, lease)
        return self.deliver(lease, prompts, groups)

    def prepare(self, lease: pb.Lease) -> list[PromptSpec]:
        """Catch up to the lease's policy version (loaded into the backend) and derive its prompts
        from the job seed. Raises AdapterBehind, EngineFailed as `catch_up` does."""
        self.catch_up(lease.policy_version)
        return self.env.prompts(self.spec.seed, list(lease.prompt_indices))

    def deliver(self, lease: pb.Lease, prompts: list[PromptSpec], groups: list[pb.Group]) -> RoundResult:
        """Grade the lease's generated `groups` (those `generate` kept), sign them and submit them
        to the trainer. Raises grpc.RpcError when the trainer can't be reached."""
        if not groups:   # every group dropped (non-finite log-probs): nothing to sign
            return RoundResult(lease.lease_id, self.loaded_version, 0, 0, ["nonfinite_logprobs"])
        kept = {g.prompt_index for g in groups}
        prompts = [p for p in prompts if p.index in kept]
        self.grade(prompts, groups)
        envelope = self.sign(lease, groups)
        return self.submit(lease, envelope, len(groups))

    def request_lease(self) -> pb.Lease | None:
        """Ask the trainer for a lease of up to `max_prompts` prompts (a signed request; refused
        as overloaded or unreachable, retried with backoff: `node.net.trainer_client`).

        Returns None when it grants none (its reason goes to `last_refusal`, its retry hint in ms
        to `last_retry_ms`). Raises grpc.RpcError
        when the trainer can't be reached.
        """
        req = pb.LeaseRequest(job_id=self.job_id, max_prompts=self.max_prompts,
                              adapter_version=max(self.replica.version, 0), created_ms=int(time.time() * 1000))
        signed = signing.sign(self.identity, signing.LEASE_REQUEST, req)
        reply = self.trainer.request_lease(signed)
        if not reply.HasField("lease"):
            self.last_refusal, self.last_retry_ms = reply.reason, int(reply.retry_after_ms)
            self.stats.leases_refused[reply.reason] += 1
            return None
        return reply.lease

    def catch_up(self, version: int) -> None:
        """Bring the adapter replica to at least `version` (deltas from peers or the trainer, or a
        snapshot past the gap limit) and load it into the backend."""
        self._sync(version)
        if self.replica.version < version:
            raise AdapterBehind(f"adapter sources served up to {self.replica.version}, lease wants {version}")
        state, held, digest = self.sync.held()
        if (held, digest) != (self.loaded_version, self.loaded_hash):
            assert state is not None
            with_recovery(self.backend, lambda: self.backend.set_adapter(self.job_id, state),
                          what=f"job {self.job_id[:12]} adapter load", on_fault=self.stats.engine_fault)
            self.loaded_version, self.loaded_hash = held, digest

    def catch_up_to_head(self) -> None:
        """Ask at the head (issue 24): bring the replica to the version the job's record names
        before asking for a lease, so the lease's staleness clock does not run while this worker
        fetches the version it will sample with (a lease is granted at the trainer's head; in the
        simulator, asking at the head took 10,000 workers from 0.43 to 0.40 of their groups wasted
        and from 0.78x to 0.97x the groups trained, docs/MARKET.md). The prefetch thread
        usually got there first; a source that fails here is tried again by `catch_up`."""
        self.chosen_s = time.monotonic()
        head = int(self.record.head_version)
        if self.replica.version >= head:
            return
        try:
            self._sync(head)
        except Exception as exc:  # noqa: BLE001 - a peer or the trainer failed: catch_up after the lease retries
            log.info("job %s: catching up to head %d before the lease failed: %r", self.job_id[:12], head, exc)

    def _sync(self, version: int) -> None:
        """Bring the replica to `version` on the lease's path (a catch-up is counted when it moved)."""
        t0, before = time.monotonic(), self.replica.version
        self.sync.run(version)
        if self.replica.version != before:
            self.stats.caught_up(time.monotonic() - t0)

    def prefetch(self, version: int) -> None:
        """Bring the replica (not the backend) to `version` ahead of the next lease."""
        self.sync.run(version)

    def generate(self, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        """Sample the lease's G completions per prompt with the job's adapter, under the lease's
        sampling parameters and a fresh random seed; ungraded groups in `prompts` order, each
        completion stamped with the adapter version loaded (`loaded_version`) and its hash.

        A group with a non-finite sampling log-prob (an engine fault: fp16 overflow, a broken
        adapter) is dropped here, never signed, and counted (`groups_dropped["nonfinite_logprobs"]`).
        Engine faults are retried after the backend recovers (`engine.with_recovery`); raises
        EngineFailed when they persist.
        """
        if isinstance(self.env, EpisodeEnv):   # multi-turn: G episodes per prompt
            env = self.env
            t0 = time.monotonic()
            groups = with_recovery(self.backend, lambda: episode_groups(self.backend, self.spec, env, prompts, lease,
                                                                        adapter=self.job_id,
                                                                        policy_version=self.loaded_version,
                                                                        adapter_hash=self.loaded_hash),
                                   what=f"job {self.job_id[:12]} episodes", on_fault=self.stats.engine_fault)
            self.stats.generated(sum(len(g.completions) for g in groups),
                                 sum(sum(c.token_mask) for g in groups for c in g.completions), time.monotonic() - t0)
            return self._finite(groups, lease)
        request = self.request(prompts, lease)
        t0 = time.monotonic()
        outs = with_recovery(self.backend, lambda: self.backend.generate(request.prompt_token_ids, request.sampling,
                                                                         adapter=request.adapter),
                             what=f"job {self.job_id[:12]} generate", on_fault=self.stats.engine_fault)
        return self.groups_from(prompts, request, outs, lease, time.monotonic() - t0)

    @property
    def plays_episodes(self) -> bool:
        """Whether the job's environment plays multi-turn episodes (its rounds generate turn by turn)."""
        return isinstance(self.env, EpisodeEnv)

    def request(self, prompts: list[PromptSpec], lease: pb.Lease) -> GenerateRequest:
        """The single-turn generate request of a lease: its prompts' ids, its sampling parameters
        with a fresh random seed, this job's adapter slot."""
        s = lease.sampling
        sampling = Sampling(n=s.n, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            stop=tuple(s.stop), seed=int.from_bytes(os.urandom(4), "little"))
        prompt_ids = [render_prompt(self.backend.tokenizer, p, self.spec.chat_template) for p in prompts]
        return GenerateRequest(prompt_ids, sampling, adapter=self.job_id)

    def groups_from(self, prompts: list[PromptSpec], request: GenerateRequest, outs: list[list[SampledCompletion]],
                    lease: pb.Lease, seconds: float) -> list[pb.Group]:
        """The ungraded groups of `request`'s completions `outs` [prompt][n] (generated in
        `seconds` of wall time, this job's share of a call), counted; the non-finite dropped."""
        self.stats.generated(sum(map(len, outs)), sum(len(c.token_ids) for cs in outs for c in cs), seconds)
        groups = [pb.Group(prompt_index=p.index, prompt_token_ids=ids, completions=[self._completion(c) for c in comps])
                  for p, ids, comps in zip(prompts, request.prompt_token_ids, outs)]
        return self._finite(groups, lease)

    def _finite(self, groups: list[pb.Group], lease: pb.Lease) -> list[pb.Group]:
        """The groups whose sampling log-probs are all finite; the rest are counted and dropped."""
        kept = [g for g in groups if all(math.isfinite(x) for c in g.completions for x in c.logprobs)]
        if len(kept) < len(groups):
            self.stats.groups_dropped["nonfinite_logprobs"] += len(groups) - len(kept)
            log.warning("lease %s: %d/%d groups dropped unsigned: non-finite sampling log-probs (engine fault)",
                        lease.lease_id, len(groups) - len(kept), len(groups))
        return kept

    def _completion(self, c: SampledCompletion) -> pb.Completion:
        return pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                             policy_version=self.loaded_version, adapter_hash=self.loaded_hash)

    def grade(self, prompts: list[PromptSpec], groups: list[pb.Group]) -> None:
        """Reward every completion (in the grading subprocess pool); failures are recorded."""
        texts: list[str] = []
        prompt_texts: list[str] = []
        infos: list[dict[str, Any]] = []
        targets: list[pb.Completion] = []
        for p, g in zip(prompts, groups):
            group_texts, group_infos = grade_rows(self.backend.tokenizer, self.env, p, g)
            texts += group_texts
            infos += group_infos
            prompt_texts += [p.text] * len(group_texts)
            targets += list(g.completions)
        for c, grade in zip(targets, self.grader.grade(prompt_texts, texts, infos)):
            c.rewards.extend(math.nan if r is None else float(r) for r in grade.rewards)
            c.reward = math.nan if grade.reward is None else float(grade.reward)
            c.grade_error = grade.error
            self.stats.rollouts_graded += 1
            self.stats.grade_failures += grade.reward is None

    def sign(self, lease: pb.Lease, groups: list[pb.Group]) -> pb.Signed:
        """The groups as a RolloutBatch answering `lease`, signed by this worker (fresh nonce, now)."""
        batch = pb.RolloutBatch(job_id=self.job_id, lease_id=lease.lease_id, peer_id=self.identity.peer_id,
                                groups=groups, created_ms=int(time.time() * 1000), nonce=os.urandom(16))
        return signing.sign(self.identity, signing.ROLLOUT_BATCH, batch)

    def submit(self, lease: pb.Lease, envelope: pb.Signed, n_groups: int) -> RoundResult:
        """Send a signed batch to the trainer (refused as overloaded or unreachable, the same
        batch is resent with backoff: `node.net.trainer_client`) and read its receipt.

        Returns what was admitted, with the rejection reasons (the batch's, or each rejected group's).
        Raises grpc.RpcError when the trainer can't be reached.
        """
        b = self.trainer.submit_rollouts(envelope)
        if b.accepted:
            self.keep_receipt(b, envelope)
        reasons = [b.reason] if not b.accepted else [g.reason for g in b.groups if not g.admitted]
        admitted = sum(g.admitted for g in b.groups)
        self.stats.groups_submitted += n_groups
        self.stats.groups_admitted += admitted
        self.stats.groups_refused.update([b.reason] * n_groups if not b.accepted else
                                         [g.reason for g in b.groups if not g.admitted])
        if reasons:
            log.warning("lease %s: %d/%d groups admitted, rejected: %s", lease.lease_id, admitted, n_groups, reasons)
        return RoundResult(lease.lease_id, self.loaded_version, n_groups, admitted, reasons)

    def keep_receipt(self, answer: pb.BatchReceipt, envelope: pb.Signed) -> bool:
        """Verify the trainer's signed receipt in its `answer` to `envelope` (signed by the trainer
        this session follows, about this very batch: `protocol.receipts.verify_receipt`) and keep
        it. A receipt that fails is refused, counted by reason (`stats.receipts_refused`) and
        logged; the session carries on. Returns whether the receipt verified."""
        trainer_id = peer_id_from_public_key(bytes(self.record.trainer_public_key))
        batch_id = signing.envelope_id(envelope)
        try:
            verify_receipt(answer, pb.RolloutBatch.FromString(envelope.body), batch_id, trainer_id)
        except ReceiptError as exc:
            self.stats.receipts_refused[exc.reason] += 1
            log.warning("batch %s: receipt refused (%s)", batch_id[:12], exc)
            return False
        self.stats.receipts_kept += 1
        if self.receipts is not None:
            self.receipts.add(answer.signed)
        return True


def prefetch_followed(sessions: Mapping[str, JobSession], heads: Mapping[str, int], follow_idle_s: float,
                      now_s: float) -> list[str]:
    """Bring the replica of every followed job to its announced head (the prefetch thread's pass);
    returns the jobs it moved. Followed: a round chose the job within `follow_idle_s` of `now_s`
    (monotonic s; `protocol.market.follows`, 0: every session). `heads`: job id -> the newest
    head version its records announce. A source's failure propagates (the caller retries)."""
    moved = []
    for job_id, session in list(sessions.items()):
        head = heads.get(job_id, -1)
        if session.replica.version < head and follows(session.chosen_s, now_s, follow_idle_s):
            session.prefetch(head)
            moved.append(job_id)
    return moved
