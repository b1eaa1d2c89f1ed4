"""A worker's round over several jobs' leases at once, on a backend that batches adapters (vLLM).

The round reads: each job's lease (from its own trainer, `Worker._serve_many`) -> catch up each
job to its lease's version -> generate every single-turn job's prompts in ONE engine batch
(`InferenceBackend.generate_batch`: each request on its own job's adapter version, which the
vLLM server runs as that version's `LoRARequest`) -> grade each job with its own job's reward
functions -> sign -> submit each job's rollouts to its own trainer.

What a failure costs: the steps after the batch are each job's own, each run under the
worker's guard, so a trainer that can't be reached (or a catch-up no source can serve yet)
costs that job's lease only, never the other jobs' rollouts; they are still graded, signed and
submitted. An engine fault that persists through recovery (`EngineFailed`) skips every lease of
the batch (they expire at their trainers and are handed out again). Multi-turn jobs (episodes)
play their turns on their own after the batch, as in a one-job round.

Generation time is shared between the batch's jobs in proportion to the tokens each got
(`token_shares`), so a job's tokens/s (its metrics) is the batch's, and the seconds summed over
jobs are the batch's wall time, not k times it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmrl.node.inference.base import InferenceBackend
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.worker.engine import EngineFailed, with_recovery
from swarmrl.node.worker.session import JobSession, RoundResult
from swarmrl.protocol.envs import PromptSpec
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)

Guard = Callable[[Callable[[VerifiedRecord], object], VerifiedRecord], object]
"""Runs one job's step on its record and returns its result; None when a peer, the trainer or
the engine failed (logged, the trainer skipped a while where it is unreachable): `Worker._guard`."""


@dataclass
class Held:
    """One job's lease in a round: the record followed, the job's session, the lease, and what
    the round made of it (its prompts, then its ungraded groups)."""

    record: VerifiedRecord
    session: JobSession
    lease: pb.Lease
    prompts: list[PromptSpec] = field(default_factory=list)
    groups: list[pb.Group] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        """The job's id."""
        return self.session.job_id


def token_shares(tokens: list[int]) -> list[float]:
    """Each request's share of a batch's wall time: its tokens over all tokens (equal shares
    when no token was made). Sums to 1 for a non-empty list."""
    total = sum(tokens)
    return [t / total for t in tokens] if total > 0 else [1 / len(tokens)] * len(tokens)


def run_round(backend: InferenceBackend, held: list[Held], guard: Guard) -> list[tuple[Held, RoundResult]]:
    """The round over `held` (leases already granted, every job's session on `backend`): catch
    up -> one batch -> grade -> sign -> submit per job (see the module docstring). Returns the
    jobs whose rollouts reached their trainer, with what each admitted."""
    ready = [h for h in held if guard(functools.partial(_prepare, h), h.record) is not None]
    single = [h for h in ready if not h.session.plays_episodes]
    try:
        generate_together(backend, single)
    except EngineFailed as exc:   # every lease of the batch is skipped; keep serving
        log.error("%d jobs' batch: %s; leases skipped", len(single), exc)
        single = []
    played = [h for h in ready if h.session.plays_episodes
              and guard(functools.partial(_play, h), h.record) is not None]
    out = []
    for h in single + played:
        result = guard(functools.partial(_deliver, h), h.record)
        if isinstance(result, RoundResult):
            out.append((h, result))
    return out


def generate_together(backend: InferenceBackend, held: list[Held]) -> None:
    """Sample every lease of `held` (single-turn jobs) in one `generate_batch` call, each on its
    own job's adapter, retried after engine faults (`engine.with_recovery`); sets each one's
    `groups` (counted in its job's stats, the non-finite dropped). Raises EngineFailed."""
    if not held:
        return
    requests = [h.session.request(h.prompts, h.lease) for h in held]

    def fault() -> None:
        for h in held:
            h.session.stats.engine_fault()

    t0 = time.monotonic()
    outs = with_recovery(backend, lambda: backend.generate_batch(requests),
                         what=f"batch of {len(held)} jobs", on_fault=fault)
    seconds = time.monotonic() - t0
    shares = token_shares([sum(len(c.token_ids) for cs in out for c in cs) for out in outs])
    for h, request, out, share in zip(held, requests, outs, shares, strict=True):
        h.groups = h.session.groups_from(h.prompts, request, out, h.lease, seconds * share)


def _prepare(h: Held, _rec: VerifiedRecord) -> bool:
    h.prompts = h.session.prepare(h.lease)
    return True


def _play(h: Held, _rec: VerifiedRecord) -> bool:
    h.groups = h.session.generate(h.prompts, h.lease)
    return True


def _deliver(h: Held, _rec: VerifiedRecord) -> RoundResult:
    return h.session.deliver(h.lease, h.prompts, h.groups)
