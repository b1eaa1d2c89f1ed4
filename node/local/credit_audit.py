"""The audit at the end of `swarmrl up` (issue 27, docs/CREDIT.md): the first trainer's credit
books checked as `swarmrl audit JOB --sample 0` checks them, with every worker's receipts, and
the leaderboard they add up to (`credit_summary`, what `swarmrl status JOB --peers` shows).

An honest run ends with no finding. With a trainer-side red-team mode (`--red-team omit_groups`,
`sybil_credit` or `misstated_adapter`) the audit must name it. `honest_flagged` counts the honest
workers a finding names as credited for what it did not do (every reason but `omitted_group`,
where the peer named is the one wronged): 0 in every drill.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from swarmrl.node.audit.books import AuditPlan, audit_job
from swarmrl.node.audit.client import AuditClient
from swarmrl.node.models.base_model import default_cache_dir
from swarmrl.node.worker.receipts import job_receipts, receipts_path
from swarmrl.protocol.audit import OMITTED_GROUP
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.leaderboard import read_board

log = logging.getLogger(__name__)


def audit_summary(endpoint: str, job_id: str, workers: dict[str, Identity], honest: list[str],
                  cache_dir: Path | None) -> dict[str, Any]:
    """Audit `job_id` at `endpoint` with the receipts of `workers` (process name -> key; their
    stores under `cache_dir`, default `default_cache_dir()`); `honest`: the honest workers'
    names. Returns summary.json's `audit`: findings, by_reason, peers_named (process names, or
    peer ids of keys not in the run: a sybil's), honest_flagged, statements, batches_checked, receipts_checked,
    seconds; {"error": ...} if the trainer could not be audited."""
    cache = default_cache_dir() if cache_dir is None else cache_dir
    paths = [receipts_path(cache, key.peer_id) for key in workers.values()]
    envelopes = job_receipts([p for p in paths if p.exists()], job_id)
    t0 = time.perf_counter()
    try:
        report = audit_job(AuditClient(endpoint, b""), job_id, AuditPlan(sample=0, adapters=2, seed=0),
                           Identity.generate(), receipts=envelopes)
    except Exception as exc:  # noqa: BLE001 - the summary says the audit failed; the run's results stand
        log.warning("the credit audit of job %s failed: %s", job_id[:12], exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    names = {key.peer_id: name for name, key in workers.items()}
    honest_ids = {workers[n].peer_id for n in honest}
    blamed = {f.peer_id for f in report.findings if f.peer_id and f.reason != OMITTED_GROUP}
    return {"findings": len(report.findings), "by_reason": dict(Counter(f.reason for f in report.findings)),
            "peers_named": sorted(names.get(p, p) for p in {f.peer_id for f in report.findings if f.peer_id}),
            "honest_flagged": len(blamed & honest_ids), "statements": report.statements,
            "batches_checked": report.batches_checked, "receipts_checked": report.receipts_checked,
            "seconds": round(time.perf_counter() - t0, 3)}


def credit_summary(endpoint: str, job_id: str, names: dict[str, str]) -> dict[str, Any]:
    """summary.json's `credit`: the job's leaderboard at `endpoint` with every credited batch
    checked (`read_board`, sample 0): statements, groups, tokens, findings by reason, and per
    peer (process name from `names`, peer id -> name; else the peer id) its groups, share,
    tokens, verified share and ban. {"error": ...} if it could not be read."""
    try:
        board = read_board(AuditClient(endpoint, b""), job_id, sample=0, seed=0)
    except Exception as exc:  # noqa: BLE001 - the summary says the board failed; the run's results stand
        log.warning("the leaderboard of job %s could not be read: %s", job_id[:12], exc)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"statements": board.statements, "groups": board.groups, "tokens": board.tokens,
            "findings": dict(board.findings),
            "peers": {names.get(r.peer_id, r.peer_id): {"groups": r.groups, "share": round(r.share, 4),
                                                          "tokens": r.tokens, "verified_share": r.verified_share,
                                                          "banned": r.banned}
                      for r in board.rows}}
