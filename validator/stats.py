"""The validator's tallies, one line at each event: groups and seconds per rung of the ladder
(`CheckStats`), groups checked and verdicts sent per job (`VerdictStats`). `metrics.py` reads
them at scrape time."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from swarmrl.protocol.pb import swarm_pb2 as pb


@dataclass
class CheckStats:
    """Per rung ("cheap": structure + freshness + duplicate; "regrade"; "prefill": logprob +
    plausibility): groups it ran on and wall seconds it took."""

    groups: Counter[str] = field(default_factory=Counter)
    seconds: Counter[str] = field(default_factory=Counter)

    def ran(self, rung: str, groups: int, since: float) -> None:
        """Record `groups` groups checked by `rung` since monotonic time `since`."""
        if groups:
            self.groups[rung] += groups
            self.seconds[rung] += time.monotonic() - since  # type: ignore[assignment]  # float seconds; typeshed's Counter values are int


@dataclass
class VerdictStats:
    """Admitted groups checked and verdicts sent, per job."""

    groups: Counter[str] = field(default_factory=Counter)                 # job -> groups
    verdicts: Counter[tuple[str, str, str]] = field(default_factory=Counter)  # (job, check, result)

    def sent(self, job_id: str, verdicts: list[pb.Verdict]) -> None:
        """Count `verdicts` sent for `job_id` by (check, passed/failed)."""
        self.verdicts.update((job_id, v.check, "passed" if v.passed else "failed") for v in verdicts)
