"""The validator's Prometheus metrics, read at scrape time from its tallies (`stats.py`) and its
reputation store: groups checked, verdicts by check and result, the cost of each rung of the
ladder, and the peers it knows and bans."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from swarmrl.node.ops.metrics import Families
from swarmrl.validator.stats import CheckStats

if TYPE_CHECKING:
    from swarmrl.validator.service import ValidatorService

P = "swarmrl_validator_"


def validator_metrics(service: ValidatorService) -> Iterator[Metric]:
    """The validator's metric families at scrape time (groups checked, verdicts, per-rung groups and seconds)."""
    f = Families()
    s = service.stats
    for job, n in sorted(s.groups.items()):
        f.counter(P + "groups_checked_total", "admitted groups put through the ladder", {"job_id": job}, n)
    for (job, check, result), n in sorted(s.verdicts.items()):
        f.counter(P + "verdicts_total", "verdicts sent to trainers, by check (the failed rung, or 'all') and result",
                  {"job_id": job, "check": check, "result": result}, n)
    rungs: CheckStats = CheckStats()
    for v in list(service.validators.values()):
        rungs.groups.update(v.stats.groups)
        rungs.seconds.update(v.stats.seconds)
    for rung in sorted(rungs.groups):
        f.counter(P + "check_groups_total", "groups each rung of the ladder ran on", {"check": rung}, rungs.groups[rung])
        f.counter(P + "check_seconds_total", "wall time of each rung (cost per group = rate of seconds / rate of groups)",
                  {"check": rung}, rungs.seconds[rung])
    now = int(time.time() * 1000)
    peers = service.reputation.peers()
    f.gauge(P + "peers", "peers this validator has a record of", {}, len(peers))
    f.gauge(P + "banned_peers", "peers banned at this validator now", {}, sum(p.banned(now) for p in peers))
    if (audits := service.audits) is not None:   # audit mode
        for result in ("clean", "findings", "unreachable"):
            f.counter(P + "audits_total", "audits of a job's credit books, by result", {"result": result},
                      audits.counts[result])
        for reason, n in sorted(audits.findings.items()):
            f.counter(P + "audit_findings_total", "findings of this validator's audits, by reason", {"reason": reason}, n)
        f.counter(P + "audit_reports_published_total", "signed audit reports stored in the DHT", {}, audits.published)
    yield from f
