"""Validator verdict semantics shared by validators and trainers.

A failed check whose name is in `BANNING_CHECKS` is proof of cheating (the worker's claim was
recomputed and found false): the trainer bans the peer for the job and drops its untrained
groups. Other failures lower the peer's reputation at the validator.

The trainer also bans on its own evidence, but only evidence it can pin on a key holder
(`ATTRIBUTABLE_REJECTIONS`): a batch that verifies under the peer's key and whose content is
provably wrong in a way honest software never produces (NaN log-probs, a prompt that is not the
lease's, out-of-vocabulary ids, ...), or a batch with a bad signature that carries a lease id
only the named peer was ever told (its open lease, not yet exposed through SampleAdmitted).
A bad signature alone, a replayed batch, a stale or late batch are rejected without blame:
anyone can copy a public key or a batch, and an honest slow worker goes stale.
`STRIKES_TO_BAN` such failures (one per provably wrong signed group) ban the peer for the job. Bans (both kinds) last `BAN_MS`
(longer than any job) and are rebuilt from the ledger after a restart; see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

STRUCTURE = "structure"      # schema, signature, lease, recomputed prompt
REGRADE = "regrade"          # reward recomputed from the completion text
LOGPROB = "logprob"          # sampled tokens' log-probs recomputed under the claimed policy
PLAUSIBILITY = "plausibility"  # tokens implausible under the model at the job's temperature
FRESHNESS = "freshness"      # claimed version did not exist when the lease was issued
DUPLICATE = "duplicate"      # the same completion submitted before (by anyone)
EPISODE = "episode"          # an episode's environment replies differ from a replay of its model turns
ALL = "all"                  # every check passed

BANNING_CHECKS = frozenset({STRUCTURE, REGRADE, LOGPROB, PLAUSIBILITY, FRESHNESS, DUPLICATE, EPISODE})

# Admission reasons (swarmrl.protocol.admission) a peer's own signature makes attributable to it.
ATTRIBUTABLE_REJECTIONS = frozenset({
    "signer_mismatch", "lease_peer_mismatch", "not_in_lease", "group_size", "prompt_mismatch",
    "token_out_of_vocab", "empty_completion", "length_mismatch", "non_finite", "logprob_range",
    "reward_range", "bad_finish_reason", "below_lease_version",
    # episode traces (protocol/envs/trace.py: TRACE_REASONS)
    "mask_length", "mask_value", "trace_start", "turn_count", "too_many_turns", "env_logprob",
    "unexpected_trace", "missing_trace",
})
BAD_SIGNATURE_ON_OWN_LEASE = "bad_signature_on_own_lease"   # a forged envelope naming the peer's private lease
STRIKES_TO_BAN = 3
BAN_MS = 24 * 3600 * 1000


def is_attributable(reason: str) -> bool:
    """True when a rejection for `reason` is evidence against the signing (or lease-holding) peer."""
    return reason in ATTRIBUTABLE_REJECTIONS or reason == BAD_SIGNATURE_ON_OWN_LEASE
