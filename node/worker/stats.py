"""A worker's per-job tallies, one line at each event of `JobSession`: tokens, rollouts generated,
graded, submitted, refused by reason, receipts, catch-ups. `metrics.py` reads them at scrape time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SessionStats:
    """Counters of one job session (plain ints: written by the session's thread only)."""

    tokens: int = 0                 # completion tokens generated
    generate_seconds: float = 0.0
    last_tokens_per_second: float = 0.0
    rollouts_generated: int = 0     # completions
    rollouts_graded: int = 0
    grade_failures: int = 0
    groups_submitted: int = 0
    groups_admitted: int = 0
    groups_refused: Counter[str] = field(default_factory=Counter)   # by the trainer's reason
    groups_dropped: Counter[str] = field(default_factory=Counter)   # never signed, by reason ("nonfinite_logprobs")
    engine_faults: int = 0          # backend calls that failed with BackendError (each retried or given up)
    leases_refused: Counter[str] = field(default_factory=Counter)   # "busy", "banned", "job_done", ...
    receipts_kept: int = 0          # trainer-signed batch receipts verified (and stored)
    receipts_refused: Counter[str] = field(default_factory=Counter)   # by protocol.receipts reason
    catchups: int = 0               # catch-ups that moved the adapter
    catchup_seconds: float = 0.0
    last_catchup_seconds: float = 0.0

    def generated(self, completions: int, tokens: int, seconds: float) -> None:
        """Record one generate call: `completions` rollouts, `tokens` completion tokens in `seconds` (wall)."""
        self.rollouts_generated += completions
        self.tokens += tokens
        self.generate_seconds += seconds
        self.last_tokens_per_second = tokens / seconds if seconds > 0 else 0.0

    def engine_fault(self) -> None:
        """Record one failed backend call (`worker.engine.with_recovery`)."""
        self.engine_faults += 1

    def caught_up(self, seconds: float) -> None:
        """Record one catch-up that moved the adapter, taking `seconds` (wall)."""
        self.catchups += 1
        self.catchup_seconds += seconds
        self.last_catchup_seconds = seconds
