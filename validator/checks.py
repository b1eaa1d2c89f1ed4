"""The validator's ladder of checks, cheapest first; each returns a `CheckResult`.

Legend: T = tokens of one completion.

1. structure: the worker's signature on its original envelope, the lease (job, peer, prompt
   index, admitted), recomputed prompt token ids, sizes and numbers (the trainer's own
   admission checks, reused).
2. freshness: every completion's policy version is at least the lease's and at most the
   trainer's head (a version the trainer never published did not exist).
3. duplicate: a completion (job, prompt index, token ids) first seen in another batch.
4. regrade: rewards recomputed from the decoded completion text.
5. logprob (proof of inference): log-probs recomputed in one prefill under base model + the
   adapter at the claimed version, compared with the claimed ones.
6. plausibility: the tokens are neither too surprising (random tokens, another model) nor too
   predictable (greedy passed off as sampling) for the model at the job's temperature.

A failed check names its rung (`swarmrl.protocol.verdicts`); every rung's failure is proof of a
false claim, so each is a banning check for the trainer. A rung that cannot decide (the
validator's own grader timed out, an adapter it could not fetch) returns `conclusive=False`:
no verdict is drawn from it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.envs.base import Grade
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.verdicts import DUPLICATE, FRESHNESS, LOGPROB, PLAUSIBILITY, REGRADE, STRUCTURE
from swarmrl.validator.plausibility import Plausibility

# Admission reasons that are about versions: reported as freshness, the rest as structure.
_FRESHNESS_REASONS = frozenset({adm.BELOW_LEASE_VERSION, adm.FUTURE_VERSION, adm.STALE})
# Grading errors that say nothing about the completion (the validator's grader overran or died).
_TRANSIENT_GRADE_ERRORS = ("timeout after", "grading worker died")

DUPLICATE_MIN_NATS = 20.0
"""A completion counts for the duplicate rung only when its claimed log-prob sum is at most
-DUPLICATE_MIN_NATS: an honest independent sample reproduces a given completion c with
probability p(c) = exp(sum of its log-probs) <= exp(-20) ~ 2e-9, so short, near-certain answers
("7\\n") that two honest workers may both produce are never called copies."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one rung.

    passed: the claims the rung checks hold. check: the rung's name (verdicts.*).
    detail: a short reason (for the verdict; <= 200 characters).
    conclusive: False when the rung could not decide (never a failure).
    soft_flags: honest-but-unhelpful events the rung noticed (claimed grading failures that
        regrade fine); they lower reputation without a verdict of cheating.
    """

    passed: bool
    check: str
    detail: str = ""
    conclusive: bool = True
    soft_flags: int = 0


def ok(check: str, detail: str = "", soft_flags: int = 0) -> CheckResult:
    """A passing, conclusive result of rung `check`, with the soft flags it noticed."""
    return CheckResult(True, check, detail, soft_flags=soft_flags)


def fail(check: str, detail: str) -> CheckResult:
    """A failing result of rung `check`; `detail` (the reason) is cut to 200 characters."""
    return CheckResult(False, check, detail[:200])


def undecided(check: str, detail: str) -> CheckResult:
    """A result of rung `check` that could not decide: not a failure (`conclusive` False)."""
    return CheckResult(True, check, detail[:200], conclusive=False)


# ---- 1. structure ---------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenedBatch:
    """A verified batch: its parsed body, signer and id (hex sha256 of the signed body)."""

    batch: pb.RolloutBatch
    signer: str
    batch_id: str


def check_envelope(admitted: pb.AdmittedBatch, job_id: str) -> tuple[CheckResult, OpenedBatch | None]:
    """Re-verify the worker's signature and match the batch to its lease and job.

    Returns (result, opened batch or None when the signature/body did not verify).
    """
    batch_id = signing.envelope_id(admitted.batch)
    try:
        batch, signer = signing.open_signed(admitted.batch, signing.ROLLOUT_BATCH, pb.RolloutBatch)
    except signing.SignatureError as exc:
        return fail(STRUCTURE, f"{exc.reason}: the worker's envelope does not verify"), None
    opened = OpenedBatch(batch, signer, batch_id)
    lease = admitted.lease
    if batch.peer_id != signer:
        return fail(STRUCTURE, f"{adm.SIGNER_MISMATCH}: batch names {batch.peer_id[:12]}, signed by {signer[:12]}"), opened
    if batch.job_id != job_id or lease.job_id != job_id:
        return fail(STRUCTURE, f"{adm.UNKNOWN_JOB}: batch for {batch.job_id[:12]}, lease for {lease.job_id[:12]}"), opened
    if lease.lease_id != batch.lease_id:
        return fail(STRUCTURE, f"{adm.UNKNOWN_LEASE}: batch answers {batch.lease_id[:16]}, not {lease.lease_id[:16]}"), opened
    if lease.peer_id != signer:
        return fail(STRUCTURE, f"{adm.LEASE_PEER_MISMATCH}: lease is for {lease.peer_id[:12]}"), opened
    return ok(STRUCTURE), opened


def check_group_structure(
    group: pb.Group,
    lease: pb.Lease,
    *,
    admitted_indices: Sequence[int],
    expected_prompt_ids: Sequence[int] | None,
    limits: adm.AdmissionLimits,
) -> CheckResult:
    """The trainer's group admission checks, re-run: lease membership, group size, recomputed
    prompt ids, token ids in the vocabulary, lengths, finite numbers, reward range, and the
    versions' spread within the async window (version failures report as freshness).

    expected_prompt_ids: the ids derived from (job seed, prompt index); None when the index is
    outside the lease.
    """
    idx = group.prompt_index
    if idx not in admitted_indices:
        return fail(STRUCTURE, f"prompt {idx} was not admitted from this batch")
    expected: Mapping[int, Sequence[int]] = {} if expected_prompt_ids is None else {idx: expected_prompt_ids}
    newest = max((c.policy_version for c in group.completions), default=lease.policy_version)
    reason = adm.check_group(group, lease, current_version=newest, expected_prompt_ids=expected,
                             already_admitted=(), lim=limits)
    if not reason:
        return ok(STRUCTURE)
    return fail(FRESHNESS if reason in _FRESHNESS_REASONS else STRUCTURE, f"{reason} (prompt {idx})")


# ---- 2. freshness ---------------------------------------------------------------------------


def check_freshness(group: pb.Group, lease: pb.Lease, head_version: int) -> CheckResult:
    """Claimed versions lie in [lease.policy_version, head_version].

    head_version: the trainer's head read *after* the batch was admitted (admission refuses
    versions above the head of its time, and heads only grow).
    """
    for i, c in enumerate(group.completions):
        if c.policy_version < lease.policy_version:
            return fail(FRESHNESS, f"completion {i}: version {c.policy_version} below the lease's {lease.policy_version}")
        if c.policy_version > head_version:
            return fail(FRESHNESS, f"completion {i}: version {c.policy_version} did not exist (trainer head {head_version})")
    return ok(FRESHNESS)


# ---- 3. duplicate ---------------------------------------------------------------------------


def completion_key(job_id: str, prompt_index: int, token_ids: Sequence[int]) -> str:
    """Content address of a completion: hex sha256 over job id, prompt index and token ids."""
    h = hashlib.sha256(b"swarmrl-completion\x00" + job_id.encode() + b"\x00")
    h.update(int(prompt_index).to_bytes(8, "big"))
    h.update(b"".join(int(t).to_bytes(4, "big") for t in token_ids))
    return h.hexdigest()


def is_distinctive(c: pb.Completion, min_nats: float = DUPLICATE_MIN_NATS) -> bool:
    """True when an honest second sample of `c` would be too unlikely to happen by chance."""
    return -math.fsum(c.logprobs) >= min_nats


@dataclass(frozen=True)
class FirstSeen:
    """Who submitted a completion first (as this validator saw the ledgers)."""

    peer_id: str
    batch_id: str
    seq: int


def check_duplicate(batch_id: str, first_seen: Sequence[FirstSeen | None]) -> CheckResult:
    """Fail when any completion was first seen in another batch (credit stays with the first).

    first_seen[i]: the first sighting of completion i (None: not distinctive, not tracked).
    """
    for i, seen in enumerate(first_seen):
        if seen is not None and seen.batch_id != batch_id:
            return fail(DUPLICATE, f"completion {i} first submitted by {seen.peer_id[:12]} (seq {seen.seq})")
    return ok(DUPLICATE)


# ---- 4. regrade -----------------------------------------------------------------------------


def _transient(error: str) -> bool:
    return any(marker in error for marker in _TRANSIENT_GRADE_ERRORS)


def _close(claimed: float, recomputed: float | None, tolerance: float) -> bool:
    return recomputed is not None and abs(claimed - recomputed) <= tolerance


def check_regrade(completions: Sequence[pb.Completion], grades: Sequence[Grade], tolerance: float) -> CheckResult:
    """Compare claimed rewards with rewards recomputed from the completion text.

    Policy:
    - claimed total finite: the recomputed total must exist and be within `tolerance`; so must
      every per-function reward the worker claims as a number.
    - claimed failure (total NaN, with `grade_error`): passes, counted as a soft flag when the
      completion regrades fine. The trainer masks failed completions, so the worker earns no
      credit for them; a grader crash or timeout on a loaded machine is honest. (Claiming
      failures selectively could skew a group's advantages: soft flags raise the peer's sample
      rate and lower its reputation.)
    - the validator's own grading timed out or its worker died: that completion is skipped; if
      none could be regraded the rung is inconclusive. Other grading errors (a reward function
      raising on this text) are deterministic: the recomputed reward is "failed".
    """
    if len(completions) != len(grades):
        raise ValueError(f"{len(completions)} completions but {len(grades)} grades")
    checked, soft = 0, 0
    for i, (c, g) in enumerate(zip(completions, grades, strict=True)):
        if _transient(g.error):
            continue
        checked += 1
        if math.isnan(c.reward):
            soft += int(g.reward is not None)
            continue
        if not _close(c.reward, g.reward, tolerance):
            shown = "failed" if g.reward is None else f"{g.reward:.4g}"
            return fail(REGRADE, f"completion {i}: claimed reward {c.reward:.4g}, recomputed {shown} {g.error}".strip())
        for f, (claimed, recomputed) in enumerate(zip(c.rewards, g.rewards, strict=False)):
            if not math.isnan(claimed) and not _close(claimed, recomputed, tolerance):
                return fail(REGRADE, f"completion {i}: reward function {f} claimed {claimed:.4g}, recomputed {recomputed}")
    if checked == 0:
        return undecided(REGRADE, "the validator's grader timed out on every completion")
    detail = f"{soft} claimed grading failures regrade fine" if soft else ""
    return ok(REGRADE, detail, soft_flags=soft)


# ---- 5. logprob -----------------------------------------------------------------------------


HONEST_MEAN_FLOOR = {"float32": 1e-3, "float64": 1e-3, "bfloat16": 0.15, "float16": 0.15}
"""Smallest group-mean tolerance per model dtype: fp32 25x the largest honest *per-token* gap
measured, bf16 3x the largest honest group mean (see `LogprobTolerance`)."""


@dataclass(frozen=True)
class LogprobTolerance:
    """Largest honest differences between claimed and recomputed log-probs (nats).

    mean_abs: mean of |claimed - recomputed| over every token of the group.
    max_abs: any single token.
    The group mean rather than a completion's: a 1-token completion's mean is one token's
    rounding noise, while the group's (G completions) is stable.

    Honest gaps measured here (HF sampler vs this prefill, CPU): tiny models fp32, every token
    < 4e-5 (800 completions); Gemma 3 270M bf16 with a small adapter, 24-token completions: per token median
    0.022, p99 0.14, max 0.30, group means <= 0.04; the arithmetic job's 3-4-token completions
    (G = 8): group means median 0.024, max 0.051. Hence the floors in HONEST_MEAN_FLOOR.
    Fabricated log-probs are off by ~1 nat per token.
    """

    mean_abs: float
    max_abs: float

    def __post_init__(self) -> None:
        if not (self.mean_abs > 0 and self.max_abs >= self.mean_abs):
            raise ValueError(f"need 0 < mean_abs <= max_abs, got {self.mean_abs}, {self.max_abs}")

    @classmethod
    def from_mean(cls, mean_abs: float) -> LogprobTolerance:
        """`mean_abs` with a per-token limit of max(1 nat, 10 x mean_abs)."""
        return cls(mean_abs, max(1.0, 10.0 * mean_abs))

    def floored(self, *dtypes: str) -> LogprobTolerance:
        """This tolerance, raised to at least the largest honest floor of `dtypes` ("float32",
        "bfloat16", ...: the validator's own and the one workers sample in): a tolerance below what
        honest sampling produces would ban honest peers."""
        floor = max(HONEST_MEAN_FLOOR.get(d, HONEST_MEAN_FLOOR["bfloat16"]) for d in dtypes)
        if self.mean_abs >= floor:
            return self
        return LogprobTolerance(floor, max(self.max_abs, LogprobTolerance.from_mean(floor).max_abs))


def logprob_gaps(claimed_T: Sequence[float], recomputed_T: Sequence[float]) -> list[float]:
    """|claimed - recomputed| per token; inf where either side is not finite.

    Raises ValueError when the lengths differ.
    """
    if len(claimed_T) != len(recomputed_T):
        raise ValueError(f"{len(claimed_T)} claimed log-probs but {len(recomputed_T)} recomputed")
    gaps = [abs(float(a) - float(b)) for a, b in zip(claimed_T, recomputed_T, strict=True)]
    return [g if math.isfinite(g) else math.inf for g in gaps]


def check_logprobs(
    claimed: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]], tol: LogprobTolerance
) -> CheckResult:
    """The group's claimed log-probs match the recomputed ones within `tol`.

    claimed[i], recomputed[i]: per-token log-probs [T] of completion i.
    """
    total, count, worst = 0.0, 0, 0.0
    for i, (c_T, r_T) in enumerate(zip(claimed, recomputed, strict=True)):
        gaps = logprob_gaps(c_T, r_T)
        if gaps and max(gaps) > tol.max_abs:
            t = max(range(len(gaps)), key=gaps.__getitem__)
            return fail(LOGPROB, f"completion {i} token {t}: claimed {float(c_T[t]):.4g}, recomputed "
                                 f"{float(r_T[t]):.4g} (tolerance {tol.max_abs:g})")
        total, count, worst = total + math.fsum(gaps), count + len(gaps), max([worst, *gaps])
    mean = total / count if count else 0.0
    if mean > tol.mean_abs:
        return fail(LOGPROB, f"mean |claimed - recomputed| {mean:.3g} over {count} tokens (tolerance {tol.mean_abs:g})")
    return ok(LOGPROB, f"mean gap {mean:.2g}, max {worst:.2g}")


# ---- 6. plausibility ------------------------------------------------------------------------


def check_plausibility(scores: Sequence[Plausibility], log_threshold: float) -> CheckResult:
    """Fail when any completion's e-value reaches `exp(log_threshold)` (see plausibility.py)."""
    for i, s in enumerate(scores):
        if s.log_e_high >= log_threshold:
            return fail(PLAUSIBILITY, f"completion {i}: tokens too unlikely for the model "
                                      f"(log e-value {s.log_e_high:.1f} >= {log_threshold:.1f}, {s.tokens} tokens)")
        if s.log_e_low is not None and s.log_e_low >= log_threshold:
            return fail(PLAUSIBILITY, f"completion {i}: tokens too predictable for sampling, greedy? "
                                      f"(log e-value {s.log_e_low:.1f}, argmax {s.argmax_fraction:.0%})")
    worst = max((max(s.log_e_high, s.log_e_low or -math.inf) for s in scores), default=-math.inf)
    return ok(PLAUSIBILITY, f"worst log e-value {worst:.1f}")
