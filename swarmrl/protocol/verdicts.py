"""Validator verdict semantics shared by validators and trainers.

A failed check whose name is in `BANNING_CHECKS` is proof of cheating (the worker's claim was
recomputed and found false): the trainer bans the peer for the job and drops its untrained
groups. Other failures lower the peer's reputation at the validator.
"""

from __future__ import annotations

STRUCTURE = "structure"      # schema, signature, lease, recomputed prompt
REGRADE = "regrade"          # reward recomputed from the completion text
LOGPROB = "logprob"          # sampled tokens' log-probs recomputed under the claimed policy
PLAUSIBILITY = "plausibility"  # tokens implausible under the model at the job's temperature
FRESHNESS = "freshness"      # claimed version did not exist when the lease was issued
DUPLICATE = "duplicate"      # the same completion submitted before (by anyone)
ALL = "all"                  # every check passed

BANNING_CHECKS = frozenset({STRUCTURE, REGRADE, LOGPROB, PLAUSIBILITY, FRESHNESS, DUPLICATE})
