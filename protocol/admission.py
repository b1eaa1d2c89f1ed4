"""Admission of rollout groups: the pure checks a trainer runs before a group enters its ledger.

Every rejection has a reason string (the counters and receipts use these names). The checks
are cheap, run on every group, and trust nothing the worker claims: token ids must be inside
the vocabulary, every number finite and in range, versions inside the staleness window.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from swarmrl.protocol.envs.trace import check_trace
from swarmrl.protocol.pb import swarm_pb2 as pb

# Batch-level reasons (the whole batch is refused).
BAD_SIGNATURE = "bad_signature"
MALFORMED = "malformed"
SIGNER_MISMATCH = "signer_mismatch"
BANNED = "banned"
UNKNOWN_JOB = "unknown_job"
UNKNOWN_LEASE = "unknown_lease"
LEASE_PEER_MISMATCH = "lease_peer_mismatch"
LEASE_EXPIRED = "lease_expired"
REPLAY = "replay"
OVERSIZED = "oversized"
JOB_DONE = "job_done"   # the job took its last step: nothing would train the groups
# Group-level reasons.
NOT_IN_LEASE = "not_in_lease"
DUPLICATE_GROUP = "duplicate_group"
STALE = "stale"
FUTURE_VERSION = "future_version"
BELOW_LEASE_VERSION = "below_lease_version"
GROUP_SIZE = "group_size"
PROMPT_MISMATCH = "prompt_mismatch"
TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"
TOO_LONG = "too_long"
EMPTY_COMPLETION = "empty_completion"
LENGTH_MISMATCH = "length_mismatch"
NON_FINITE = "non_finite"
LOGPROB_RANGE = "logprob_range"
REWARD_RANGE = "reward_range"
BAD_FINISH_REASON = "bad_finish_reason"
# a completion names an adapter hash this trainer never published as its version (another
# trainer's DiLoCo inner version, or garbage): never blamed, since an honest worker can hold a
# cotrainer's version, but never admitted either: nobody could recompute its log-probs here
ADAPTER_UNKNOWN = "adapter_unknown"
ADAPTER_HASH_BYTES = 32
FINISH_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True)
class AdmissionLimits:
    """What a group must satisfy; built by the trainer from the job spec and its model."""

    group_size: int
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    reward_range: tuple[float, float]
    num_reward_funcs: int
    max_async_level: int
    max_turns: int = 0
    """Multi-turn jobs: the episode's turn limit (`max_new_tokens` is then its token limit);
    0 for single-turn jobs, whose completions carry no trace mask."""


def check_batch_envelope(
    batch: pb.RolloutBatch,
    signer: str,
    lease: pb.Lease | None,
    *,
    now_ms: int,
    batch_seen: bool,
    banned: Container[str],
    lease_expired: bool | None = None,
) -> str:
    """Batch-level checks after the signature verified. Returns a reason, or "" to go on.

    lease_expired: whether the lease is past its deadline, where the caller knows it on its own
    clock (the trainer's lease book is monotonic); None compares `now_ms` with `lease.deadline_ms`.
    """
    if batch.peer_id != signer:
        return SIGNER_MISMATCH
    if signer in banned:
        return BANNED
    if batch_seen:
        return REPLAY
    if lease is None or lease.job_id != batch.job_id:
        return UNKNOWN_LEASE
    if lease.peer_id != signer:
        return LEASE_PEER_MISMATCH
    if (now_ms > lease.deadline_ms) if lease_expired is None else lease_expired:
        return LEASE_EXPIRED
    return ""


def claimed_job_id(body: bytes) -> str:
    """The job id (string field 1) that a serialized LeaseRequest or RolloutBatch body starts
    with, read without parsing the rest; "" if it doesn't start with one. Serializers write
    fields in number order, so an honest body does; a crafted one can name another job later
    (the last value wins when parsed), so this is a routing claim only: the job that gets the
    message checks the parsed job id again."""
    if len(body) < 2 or body[0] != 0x0A:
        return ""
    n, shift, i = 0, 0, 1
    while i < len(body) and i < 6:
        b = body[i]
        n |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            try:
                return body[i:i + n].decode() if i + n <= len(body) else ""
            except UnicodeDecodeError:
                return ""
        shift += 7
    return ""


def _finite(xs: Sequence[float]) -> bool:
    return all(math.isfinite(x) for x in xs)


def check_completion(c: pb.Completion, lease: pb.Lease, current_version: int, lim: AdmissionLimits) -> str:
    """Checks of one completion. Returns a reason, or "" when it is admissible."""
    n = len(c.token_ids)
    if n == 0:
        return EMPTY_COMPLETION
    if n > lim.max_new_tokens:
        return TOO_LONG
    if len(c.logprobs) != n:
        return LENGTH_MISMATCH
    reason = check_trace(c.token_ids, c.token_mask, c.logprobs, c.turns, max_turns=lim.max_turns)
    if reason:
        return reason
    if max(c.token_ids) >= lim.vocab_size:   # builtins loop in C: admission runs on every token
        return TOKEN_OUT_OF_VOCAB
    # A finite sum means every term is finite (a NaN or an infinity makes it non-finite); only
    # a non-finite sum needs the term-by-term look (finite terms can overflow a sum).
    if not math.isfinite(sum(c.logprobs)) and not _finite(c.logprobs):
        return NON_FINITE
    if max(c.logprobs) > 1e-4:
        return LOGPROB_RANGE
    if c.finish_reason not in FINISH_REASONS:
        return BAD_FINISH_REASON
    if c.policy_version > current_version:
        return FUTURE_VERSION
    if c.policy_version < lease.policy_version:
        return BELOW_LEASE_VERSION
    if current_version - c.policy_version > lim.max_async_level:
        return STALE
    return _check_rewards(c, lim)


def _check_rewards(c: pb.Completion, lim: AdmissionLimits) -> str:
    if len(c.rewards) != lim.num_reward_funcs:
        return LENGTH_MISMATCH
    if math.isnan(c.reward):
        # A failed grade is a recorded failure: allowed only when the worker says why.
        return "" if c.grade_error else NON_FINITE
    if not math.isfinite(c.reward):
        return NON_FINITE
    if not math.isfinite(sum(c.rewards)) and any(math.isinf(r) for r in c.rewards):   # NaN: a failed function
        return NON_FINITE
    lo, hi = lim.reward_range
    if not lo - 1e-6 <= c.reward <= hi + 1e-6:
        return REWARD_RANGE
    return ""


def _completions_admissible(cs: Sequence[pb.Completion], lease_version: int, current_version: int,
                            lim: AdmissionLimits) -> bool:
    """True only if `check_completion` passes every completion of `cs` (a single-turn job's):
    the same checks in one loop that reads each field once (a repeated field copied out in one
    call, `[:]`, then looped over in C), the per-token ones folded over the group. False when
    any check fails or a figure needs the exact look (a non-finite sum, which a NaN reward may
    legitimately cause; a multi-turn job): the caller then runs `check_completion` on each
    completion for the reason, so both paths give the same verdict on every group."""
    if lim.max_turns or not cs:
        return False
    top, n_rewards = lim.max_new_tokens, lim.num_reward_funcs
    oldest = max(lease_version, current_version - lim.max_async_level)   # BELOW_LEASE_VERSION, STALE
    top_ids, top_lps, totals, total = [], [], [], 0.0
    for c in cs:
        ids, lps, rewards = c.token_ids[:], c.logprobs[:], c.rewards[:]
        n = len(ids)
        if (not 0 < n <= top or len(lps) != n or c.turns or c.token_mask or c.finish_reason not in FINISH_REASONS
                or not oldest <= c.policy_version <= current_version or len(rewards) != n_rewards):
            return False
        top_ids.append(max(ids))
        top_lps.append(max(lps))
        total += sum(lps) + sum(rewards)   # finite iff every term is (or an overflow: the exact look)
        totals.append(c.reward)
    lo, hi = lim.reward_range
    return (max(top_ids) < lim.vocab_size and max(top_lps) <= 1e-4 and math.isfinite(total + sum(totals))
            and lo - 1e-6 <= min(totals) and max(totals) <= hi + 1e-6)


def check_group(
    group: pb.Group,
    lease: pb.Lease,
    *,
    current_version: int,
    expected_prompt_ids: Mapping[int, Sequence[int]],
    already_admitted: Container[int],
    lim: AdmissionLimits,
) -> str:
    """Checks of one group against its lease. Returns a reason, or "" when admissible.

    `expected_prompt_ids` maps each leased prompt index to the token ids the trainer derived
    from (job seed, index); `already_admitted` holds the lease's prompt indices admitted before.
    """
    idx = group.prompt_index
    if idx not in expected_prompt_ids:
        return NOT_IN_LEASE
    if idx in already_admitted:
        return DUPLICATE_GROUP
    if len(group.completions) != lim.group_size:
        return GROUP_SIZE
    if len(group.prompt_token_ids) > lim.max_prompt_tokens:
        return TOO_LONG
    if group.prompt_token_ids[:] != list(expected_prompt_ids[idx]):
        return PROMPT_MISMATCH
    if _completions_admissible(group.completions, lease.policy_version, current_version, lim):
        return ""
    for c in group.completions:   # some check fails: find the first completion's reason
        reason = check_completion(c, lease, current_version, lim)
        if reason:
            return reason
    return ""
