"""Red-team drill: adversarial workers, each a transformation of the honest round.

Legend: G = completions of a group, T = tokens of one completion, V = vocabulary.

The honest round is lease -> catch up -> generate -> grade -> sign -> submit
(`session.JobSession.work_once`). A red-team worker (`swarmrl worker -o red_team=MODE`, local
drills only) runs the same round with one step replaced or one message doctored:

| mode | what it changes | what should catch it |
|---|---|---|
| forged_signature | the batch's signature is garbage (its own lease, its own public key) | admission (bad_signature; attributable: the lease id was only sent to it) |
| replay | resends an earlier admitted batch verbatim (its own or, from the open SampleAdmitted RPC, another peer's), and up to REPLAY_GROUPS earlier groups re-signed under its new lease to claim the credit | admission (replay: unattributable; not_in_lease: signed, attributable, one strike per group) |
| inflated_reward | every reward claimed at the environment's maximum | validator regrade |
| fabricated_logprobs | sampling log-probs claimed confident (-0.01 per token) | validator logprob |
| random_tokens | no model at all: uniform random tokens, log-probs of its uniform sampler (-log V) | validator logprob |
| base_model_only | generates with the adapter disabled, claims the loaded version | validator logprob, once the adapter moved (version 0 equals the base model) |
| stale_version | generates with a version STALE_LAG behind the lease's, claims the lease's | validator logprob, once versions differ |
| prompt_swap | answers an easier prompt (single-digit addition) instead of the lease's | admission prompt_mismatch (signed: attributable) |
| copycat | relabels other peers' admitted completions (read from the open SampleAdmitted RPC) onto its own lease | validator logprob / regrade (duplicate when the very completion comes again) |
| nan_logprobs | one log-prob per completion is NaN | admission non_finite (signed: attributable) |
| forged_env_reply | multi-turn jobs: every environment reply of its episodes rewritten (wordle feedback "GGGGG", an easy game); single-turn jobs: the last token claimed as an environment reply | validator episode (the replay of the model's turns answers otherwise); single-turn: admission unexpected_trace (signed: attributable) |

The doctoring steps are pure functions (unit-tested with small inputs in tests/unit/test_red_team.py);
`RedTeam.work_once` strings them into a round and counts what it submitted.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from swarmrl.node.inference.base import Sampling
from swarmrl.node.models.causal_lm import encode_prompt
from swarmrl.node.net.trainer_client import ValidatorTrainer
from swarmrl.node.tasks.episode_play import encode_observation
from swarmrl.node.worker.session import JobSession, RoundResult
from swarmrl.protocol.envs import Environment, PromptSpec
from swarmrl.protocol.envs.arithmetic import apply_op, format_prompt
from swarmrl.protocol.envs.trace import ENV, MODEL, spans
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.red_team_modes import (
    BASE_MODEL_ONLY,
    COPYCAT,
    FABRICATED_LOGPROBS,
    FORGED_ENV_REPLY,
    FORGED_SIGNATURE,
    INFLATED_REWARD,
    MODES,
    NAN_LOGPROBS,
    PROMPT_SWAP,
    RANDOM_TOKENS,
    REPLAY,
    STALE_VERSION,
)

log = logging.getLogger(__name__)


FABRICATED_LOGPROB = -0.01   # what a fabricating worker claims per token (a "confident" sample)
STALE_LAG = 2                # versions behind the lease's that stale_version generates with
EASY_PROBLEM = (1, "+", 1)   # what prompt_swap answers instead of the lease's prompt (arithmetic jobs)
REPLAY_GROUPS = 4            # earlier groups a replaying worker re-signs per round (credit it did not earn)
REPLAY_MEMORY = 64           # earlier batches and groups a replaying worker keeps


def check_mode(mode: str) -> str:
    """`mode` if it is a known red-team mode. Raises ValueError otherwise."""
    if mode not in MODES:
        raise ValueError(f"unknown red-team mode {mode!r}; known: {', '.join(MODES)}")
    return mode


# ---- pure doctoring steps --------------------------------------------------------------------


def forge_signature(envelope: pb.Signed) -> pb.Signed:
    """The same body and public key with a signature that does not verify (bytes flipped)."""
    forged = pb.Signed()
    forged.CopyFrom(envelope)
    forged.signature = bytes(b ^ 0xFF for b in envelope.signature)
    return forged


def inflate_rewards(groups: Sequence[pb.Group], reward_max: float, per_function: float = 1.0) -> None:
    """Claim the total `reward_max` for every completion, and `per_function` from every reward
    function (in place)."""
    for g in groups:
        for c in g.completions:
            c.reward = reward_max
            c.rewards[:] = [per_function] * len(c.rewards)
            c.grade_error = ""


def fabricate_logprobs(groups: Sequence[pb.Group], value: float = FABRICATED_LOGPROB) -> None:
    """Claim `value` as every sampled token's log-prob (in place)."""
    for g in groups:
        for c in g.completions:
            c.logprobs[:] = [value] * len(c.token_ids)


def poison_logprobs(groups: Sequence[pb.Group]) -> None:
    """Set each completion's first log-prob to NaN (in place)."""
    for g in groups:
        for c in g.completions:
            if len(c.logprobs):
                c.logprobs[0] = math.nan


FORGED_REPLY = "GGGGG\nGuess:"   # what forged_env_reply writes in place of every environment reply


def forge_env_replies(groups: Sequence[pb.Group], reply_ids: Sequence[int]) -> int:
    """Replace every environment reply of every episode by `reply_ids` (in place; the model's
    tokens and log-probs are kept, the mask follows the new lengths). A single-turn completion
    instead claims its last token as the environment's. Returns the replies forged."""
    forged = 0
    for g in groups:
        for c in g.completions:
            if not c.token_mask:
                c.token_mask[:] = [MODEL] * (len(c.token_ids) - 1) + [ENV]
                c.logprobs[-1] = 0.0
                c.turns = 1
                forged += 1
                continue
            ids, lps, mask = [], [], []
            for m, lo, hi in spans(list(c.token_mask)):
                if m == MODEL:
                    ids += c.token_ids[lo:hi]
                    lps += c.logprobs[lo:hi]
                    mask += [MODEL] * (hi - lo)
                else:
                    ids += reply_ids
                    lps += [0.0] * len(reply_ids)
                    mask += [ENV] * len(reply_ids)
                    forged += 1
            c.token_ids[:], c.logprobs[:], c.token_mask[:] = ids, lps, mask
    return forged


def claim_version(groups: Sequence[pb.Group], version: int) -> None:
    """Claim `version` as every completion's policy version (in place)."""
    for g in groups:
        for c in g.completions:
            c.policy_version = version


def random_completion(rng: random.Random, allowed_ids: Sequence[int], length: int, vocab: int) -> pb.Completion:
    """`length` tokens drawn uniformly from `allowed_ids`, each claimed at the log-prob of that
    uniform draw (-log len(allowed_ids)); `vocab` only bounds the ids. Raises ValueError when
    there is nothing to draw from or an id is outside [0, vocab)."""
    if not allowed_ids or length < 1:
        raise ValueError("need at least one allowed id and length >= 1")
    if any(not 0 <= t < vocab for t in allowed_ids):
        raise ValueError(f"allowed ids must lie in [0, {vocab})")
    ids = [rng.choice(allowed_ids) for _ in range(length)]
    lp = -math.log(len(allowed_ids))
    return pb.Completion(token_ids=ids, logprobs=[lp] * length, finish_reason="length")


def relabel(group: pb.Group, prompt_index: int, prompt_token_ids: Sequence[int], version: int) -> pb.Group:
    """Another peer's group presented as an answer to `prompt_index` at `version` (a copy:
    completions, log-probs and rewards unchanged)."""
    out = pb.Group()
    out.CopyFrom(group)
    out.prompt_index = prompt_index
    out.prompt_token_ids[:] = list(prompt_token_ids)
    claim_version([out], version)
    return out


def easy_prompt(env: Environment, seed: int, prompt: PromptSpec) -> PromptSpec:
    """An easier prompt standing in for `prompt` (same index): 1+1 on arithmetic jobs, else the
    job's prompt 0."""
    if env.name == "arithmetic":
        a, op, b = EASY_PROBLEM
        return PromptSpec(index=prompt.index, text=format_prompt(a, op, b),
                          info={"answer": apply_op(a, op, b), "family": "easy"})
    first = env.prompt(seed, 0)
    return PromptSpec(index=prompt.index, text=first.text, info=first.info)


def reassign(groups: Sequence[pb.Group], lease: pb.Lease) -> list[pb.Group]:
    """Old groups (from earlier leases) re-presented unchanged, with the new lease's version:
    their prompt indices are not the lease's."""
    out = []
    for g in groups:
        copy = pb.Group()
        copy.CopyFrom(g)
        claim_version([copy], lease.policy_version)
        out.append(copy)
    return out


def admitted_groups(admitted: Sequence[pb.AdmittedBatch], exclude_peer: str = "") -> list[pb.Group]:
    """The admitted groups in `admitted`, except those signed by `exclude_peer` (batch bodies read
    without verification: a copying or replaying worker does not care who signed them)."""
    out: list[pb.Group] = []
    for a in admitted:
        try:
            batch = pb.RolloutBatch.FromString(a.batch.body)
        except Exception as exc:  # noqa: BLE001 - a body we can't parse is nothing to copy
            log.debug("unparseable admitted batch %d: %r", a.seq, exc)
            continue
        if exclude_peer and batch.peer_id == exclude_peer:
            continue
        keep = set(a.admitted_prompt_indices)
        out.extend(g for g in batch.groups if g.prompt_index in keep)
    return out


# ---- the adversarial round -------------------------------------------------------------------


@dataclass
class RedTeamStats:
    """What an adversarial worker did (reported in its ready file for the drill's summary)."""

    mode: str
    submitted_groups: int = 0
    submitted_batches: int = 0
    admitted_groups: int = 0
    first_submit_ms: int | None = None
    last_reasons: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        """The counters as a JSON-ready dict (the last five rejection reasons only)."""
        return {"mode": self.mode, "submitted_groups": self.submitted_groups,
                "submitted_batches": self.submitted_batches, "admitted_groups": self.admitted_groups,
                "first_submit_ms": self.first_submit_ms, "last_reasons": self.last_reasons[-5:]}


class RedTeam:
    """One adversarial mode's round over a `JobSession` (the worker's `_round` calls `work_once`)."""

    def __init__(self, mode: str, seed: int | None = None) -> None:
        self.mode = check_mode(mode)
        self.rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self.stats = RedTeamStats(mode)
        self._history: dict[str, dict[int, dict[str, torch.Tensor]]] = {}   # job -> version -> adapter state
        self._sent: list[pb.Signed] = []          # replay: earlier admitted envelopes (own and others')
        self._old_groups: list[pb.Group] = []     # replay: earlier groups (own and others')
        self._cursor: dict[str, int] = {}         # copycat, replay: SampleAdmitted cursor per job
        self._pool: list[pb.Group] = []           # copycat: foreign groups to copy

    def report(self) -> dict[str, Any]:
        """What this adversary did so far (`RedTeamStats.report`), for the drill's summary."""
        return self.stats.report()

    def work_once(self, session: JobSession) -> RoundResult | None:
        """One adversarial lease round. Returns None when the trainer granted no lease."""
        lease = session.request_lease()
        if lease is None:
            return None
        if self.mode == REPLAY:
            self._collect_replayable(session)
            if self._old_groups:
                return self._replay(session, lease)
            # nothing admitted anywhere yet: work honestly this round (SampleAdmitted will
            # return this batch too, for later rounds to replay)
        session.catch_up(lease.policy_version)
        self._remember_adapter(session)
        prompts = session.env.prompts(session.spec.seed, list(lease.prompt_indices))
        groups = self.generate(session, prompts, lease)
        self.doctor_groups(session, groups)
        envelope = session.sign(lease, groups)
        if self.mode == FORGED_SIGNATURE:
            envelope = forge_signature(envelope)
        return self._submit(session, lease, envelope, len(groups))

    def _collect_replayable(self, session: JobSession) -> None:
        """Add the batches admitted since the last round (anyone's, from SampleAdmitted) to what
        the replaying worker can resend."""
        batches = self._admitted_since_last_round(session)
        self._sent = (self._sent + [b.batch for b in batches])[-REPLAY_MEMORY:]
        self._old_groups = (self._old_groups + admitted_groups(batches))[-REPLAY_MEMORY:]

    def _admitted_since_last_round(self, session: JobSession) -> list[pb.AdmittedBatch]:
        """Batches the trainer admitted since this worker last asked (its open SampleAdmitted RPC)."""
        after = self._cursor.get(session.job_id, 0)
        if not isinstance(session.trainer, ValidatorTrainer):
            raise TypeError("the replay drill reads admitted batches: its trainer client must also be a ValidatorTrainer")
        batches = session.trainer.sample_admitted(pb.SampleRequest(job_id=session.job_id, after_seq=after,
                                                                   max_batches=64))
        if batches:
            self._cursor[session.job_id] = max(int(b.seq) for b in batches)
        return batches

    def _replay(self, session: JobSession, lease: pb.Lease) -> RoundResult:
        """Resend an earlier batch verbatim (it credits its original signer, so it is refused as a
        replay without blame), then claim up to REPLAY_GROUPS earlier groups as this lease's work
        under its own signature (their prompts are not the lease's)."""
        if self._sent:
            verbatim = self._sent[-1]
            self._submit(session, lease, verbatim, len(pb.RolloutBatch.FromString(verbatim.body).groups))
        stale = reassign(self._old_groups[-REPLAY_GROUPS:], lease)
        return self._submit(session, lease, session.sign(lease, stale), len(stale))

    # ---- generate (honest, or the mode's replacement)
    def generate(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        """The lease's groups as this mode makes them, graded (the grades are honest).

        random_tokens: uniform non-special tokens; base_model_only: sampled with the adapter off;
        stale_version: sampled with an adapter `STALE_LAG` versions old, claiming the lease's;
        prompt_swap: answers to an easier prompt under the lease's indices; copycat: other workers'
        admitted groups relabelled (honest groups while none are at hand). Every other mode
        generates honestly and cheats afterwards (`doctor_groups`, signing or submitting).
        """
        if self.mode == RANDOM_TOKENS:
            return self._random_groups(session, prompts, lease)
        if self.mode == BASE_MODEL_ONLY:
            return self._generate_with(session, prompts, lease, adapter=None)
        if self.mode == STALE_VERSION:
            return self._stale_groups(session, prompts, lease)
        if self.mode == PROMPT_SWAP:
            return self._swapped_groups(session, prompts, lease)
        if self.mode == COPYCAT:
            copied = self._copied_groups(session, prompts, lease)
            if copied is not None:
                return copied
        groups = session.generate(prompts, lease)
        session.grade(prompts, groups)
        return groups

    def _generate_with(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease,
                       adapter: str | None) -> list[pb.Group]:
        s = lease.sampling
        sampling = Sampling(n=s.n, max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                            stop=tuple(s.stop), seed=self.rng.getrandbits(31))
        tok = session.backend.tokenizer
        prompt_ids = [encode_prompt(tok, p.text) for p in prompts]
        outs = session.backend.generate(prompt_ids, sampling, adapter=adapter)
        groups = [pb.Group(prompt_index=p.index, prompt_token_ids=ids,
                           completions=[pb.Completion(token_ids=c.token_ids, logprobs=c.logprobs,
                                                      finish_reason=c.finish_reason,
                                                      policy_version=session.loaded_version) for c in comps])
                  for p, ids, comps in zip(prompts, prompt_ids, outs)]
        session.grade(prompts, groups)
        return groups

    def _random_groups(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        tok = session.backend.tokenizer
        vocab = int(session.backend.vocab_size)
        special = set(getattr(tok, "all_special_ids", [])) | set(session.backend.eos_token_ids)
        allowed = [t for t in range(min(vocab, len(tok))) if t not in special]
        n, length = lease.sampling.n, lease.sampling.max_new_tokens
        groups = [pb.Group(prompt_index=p.index, prompt_token_ids=encode_prompt(tok, p.text),
                           completions=[random_completion(self.rng, allowed, length, vocab) for _ in range(n)])
                  for p in prompts]
        claim_version(groups, session.loaded_version)
        session.grade(prompts, groups)
        return groups

    def _remember_adapter(self, session: JobSession) -> None:
        if self.mode != STALE_VERSION:
            return
        state, version, _ = session.sync.held()
        if state is None:
            return
        history = self._history.setdefault(session.job_id, {})
        history[version] = {k: v.detach().clone() for k, v in state.items()}
        for v in sorted(history)[:-(STALE_LAG + 2)]:
            del history[v]

    def _stale_groups(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        history = self._history.get(session.job_id, {})
        if not history:
            return self._generate_with(session, prompts, lease, adapter=session.job_id)
        older = [v for v in history if v <= lease.policy_version - STALE_LAG]
        used = max(older) if older else min(history)
        session.backend.set_adapter(session.job_id, history[used])
        try:
            groups = self._generate_with(session, prompts, lease, adapter=session.job_id)
        finally:
            session.loaded_version = -1   # the backend holds an old version: the next catch-up reloads
        claim_version(groups, lease.policy_version)
        log.info("stale_version: generated with v%d, claimed v%d", used, lease.policy_version)
        return groups

    def _swapped_groups(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group]:
        easy = [easy_prompt(session.env, session.spec.seed, p) for p in prompts]
        return self._generate_with(session, easy, lease, adapter=session.job_id)

    def _copied_groups(self, session: JobSession, prompts: list[PromptSpec], lease: pb.Lease) -> list[pb.Group] | None:
        batches = self._admitted_since_last_round(session)
        self._pool.extend(admitted_groups(batches, exclude_peer=session.identity.peer_id))
        if len(self._pool) < len(prompts):
            return None   # nothing to copy yet: work honestly (and build a reputation)
        tok = session.backend.tokenizer
        out = []
        for p in prompts:
            source = self._pool.pop()
            out.append(relabel(source, p.index, encode_prompt(tok, p.text), lease.policy_version))
        return out

    # ---- doctor the graded groups
    def doctor_groups(self, session: JobSession, groups: list[pb.Group]) -> None:
        """Alter graded groups in place for the modes that lie about numbers: inflated_reward
        (every reward set to the environment's maximum), fabricated_logprobs, nan_logprobs,
        forged_env_reply (the grades stay those of the honest episodes).
        """
        if self.mode == INFLATED_REWARD:
            inflate_rewards(groups, float(session.env.reward_range[1]))
        elif self.mode == FABRICATED_LOGPROBS:
            fabricate_logprobs(groups)
        elif self.mode == NAN_LOGPROBS:
            poison_logprobs(groups)
        elif self.mode == FORGED_ENV_REPLY:
            forge_env_replies(groups, encode_observation(session.backend.tokenizer, FORGED_REPLY))

    # ---- submit and count
    def _submit(self, session: JobSession, lease: pb.Lease, envelope: pb.Signed, n_groups: int) -> RoundResult:
        now = int(time.time() * 1000)
        if self.stats.first_submit_ms is None:
            self.stats.first_submit_ms = now
        self.stats.submitted_batches += 1
        self.stats.submitted_groups += n_groups
        result = session.submit(lease, envelope, n_groups)
        self.stats.admitted_groups += result.admitted
        self.stats.last_reasons = (self.stats.last_reasons + result.reasons)[-10:]
        return result
