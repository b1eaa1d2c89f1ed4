"""One worker's work on one job: lease -> catch up -> generate -> grade -> sign -> submit."""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import grpc

from swarmrl.node.grading import GradingPool
from swarmrl.node.grpc_options import channel_options
from swarmrl.node.inference.base import InferenceBackend, Sampling, SampledCompletion
from swarmrl.node.models import encode_prompt
from swarmrl.node.worker.adapter_sync import AdapterReplica, assemble
from swarmrl.protocol import signing
from swarmrl.protocol.envs import PromptSpec, get_environment
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.jobspec import JobSpec
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_GAP = 8  # versions behind past which a snapshot is cheaper than the delta chain


@dataclass
class RoundResult:
    """What one lease round produced (for logs and tests)."""

    lease_id: str
    policy_version: int
    groups: int
    admitted: int
    reasons: list[str]


class JobSession:
    """A worker's connection to one job's trainer, its adapter replica and grading pool."""

    def __init__(self, record: pb.JobRecord, *, identity: Identity, backend: InferenceBackend,
                 max_prompts: int, max_message_mb: int, grade_timeout_s: float) -> None:
        self.record = record
        self.spec = JobSpec.from_json(record.spec_json)
        self.identity, self.backend, self.max_prompts = identity, backend, max_prompts
        self.env = get_environment(self.spec.environment, self.spec.env_version)
        self.channel = grpc.insecure_channel(record.endpoint, options=channel_options(max_message_mb))
        self.stub = pb_grpc.TrainerStub(self.channel)
        self.replica = AdapterReplica(record.job_id, bytes(record.trainer_public_key))
        self.grader = GradingPool(self.spec.environment, self.spec.env_version, timeout_s=grade_timeout_s)

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def close(self) -> None:
        self.grader.close()
        self.channel.close()
        self.backend.remove_adapter(self.job_id)

    # ---- the round
    def work_once(self) -> RoundResult | None:
        """One lease, end to end. Returns None when the trainer granted no lease."""
        lease = self.request_lease()
        if lease is None:
            return None
        self.catch_up(lease.policy_version)
        prompts = self.env.prompts(self.spec.seed, list(lease.prompt_indices))
        groups = self.generate(prompts, lease)
        self.grade(prompts, groups)
        envelope = self.sign(lease, groups)
        return self.submit(lease, envelope, len(groups))

    def request_lease(self) -> pb.Lease | None:
        req = pb.LeaseRequest(job_id=self.job_id, max_prompts=self.max_prompts,
                              adapter_version=max(self.replica.version, 0), created_ms=int(time.time() * 1000))
        reply = self.stub.RequestLease(signing.sign(self.identity, signing.LEASE_REQUEST, req), timeout=30)
        if not reply.HasField("lease"):
            self.last_refusal = reply.reason
            return None
        return reply.lease

    def catch_up(self, version: int) -> None:
        """Bring the adapter replica to at least `version` (deltas, or a snapshot past MAX_GAP)."""
        if self.replica.version >= version:
            return
        snapshot = self.replica.version < 0 or version - self.replica.version > MAX_GAP
        req = pb.AdapterRequest(job_id=self.job_id, have_version=max(self.replica.version, 0),
                                want_version=version, snapshot=snapshot)
        for update in assemble(self.stub.FetchAdapter(req, timeout=120), self.replica.trainer_id):
            self.replica.apply(update)
        if self.replica.version < version:
            raise RuntimeError(f"trainer served adapter up to {self.replica.version}, lease wants {version}")
        assert self.replica.state is not None
        self.backend.set_adapter(self.job_id, self.replica.state)

    def generate(self, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        s = lease.sampling
        sampling = Sampling(n=s.n, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            stop=tuple(s.stop), seed=int.from_bytes(os.urandom(4), "little"))
        prompt_ids = [encode_prompt(self.backend.tokenizer, p.text) for p in prompts]
        outs = self.backend.generate(prompt_ids, sampling, adapter=self.job_id)
        return [pb.Group(prompt_index=p.index, prompt_token_ids=ids,
                         completions=[self._completion(c) for c in comps])
                for p, ids, comps in zip(prompts, prompt_ids, outs)]

    def _completion(self, c: SampledCompletion) -> pb.Completion:
        return pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                             policy_version=self.replica.version)

    def grade(self, prompts: list[PromptSpec], groups: list[pb.Group]) -> None:
        """Reward every completion (in the grading subprocess pool); failures are recorded."""
        tok = self.backend.tokenizer
        texts, prompt_texts, infos, targets = [], [], [], []
        for p, g in zip(prompts, groups):
            for c in g.completions:
                texts.append(tok.decode(list(c.token_ids), skip_special_tokens=True))
                prompt_texts.append(p.text)
                infos.append(p.info)
                targets.append(c)
        for c, grade in zip(targets, self.grader.grade(prompt_texts, texts, infos)):
            c.rewards.extend(math.nan if r is None else float(r) for r in grade.rewards)
            c.reward = math.nan if grade.reward is None else float(grade.reward)
            c.grade_error = grade.error

    def sign(self, lease: pb.Lease, groups: list[pb.Group]) -> pb.Signed:
        batch = pb.RolloutBatch(job_id=self.job_id, lease_id=lease.lease_id, peer_id=self.identity.peer_id,
                                groups=groups, created_ms=int(time.time() * 1000), nonce=os.urandom(16))
        return signing.sign(self.identity, signing.ROLLOUT_BATCH, batch)

    def submit(self, lease: pb.Lease, envelope: pb.Signed, n_groups: int) -> RoundResult:
        receipt = self.stub.SubmitRollouts(iter([envelope]), timeout=60)
        b = receipt.batches[0]
        reasons = [b.reason] if not b.accepted else [g.reason for g in b.groups if not g.admitted]
        admitted = sum(g.admitted for g in b.groups)
        if reasons:
            log.warning("lease %s: %d/%d groups admitted, rejected: %s", lease.lease_id, admitted, n_groups, reasons)
        return RoundResult(lease.lease_id, self.replica.version, n_groups, admitted, reasons)
