"""Audit reports in the public record: each auditor's newest signed `AuditReport` of a job, in the
DHT (issue 27 item 3, docs/CREDIT.md section 3).

Anyone who audits a trainer's books (`swarmrl audit JOB --publish`) may publish the report it
signed under `swarmrl/v1/audits/{job_id}`, subkey = the auditor's Ed25519 peer id, so a later
report by the same auditor replaces its earlier one. A report carries its own evidence (the
findings name versions, batches and peers that anyone can re-check), so an untrusted auditor's
report is worth reading; whose reports ban a worker is still each trainer's `trusted_validators`.
Readers verify every entry and drop the ones whose signer is not the subkey, not the report's
auditor, or about another job. Records expire after `AUDIT_TTL_S`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import hivemind
from hivemind.utils import get_dht_time

from swarmrl.node.swarm.dht import signed_entries
from swarmrl.protocol import signing
from swarmrl.protocol.pb import swarm_pb2 as pb

log = logging.getLogger(__name__)
AUDIT_TTL_S = 24 * 3600.0   # a day: an audit is evidence about the past, not a liveness record


def audits_key(job_id: str) -> str:
    """The DHT key under which auditors publish their reports of `job_id` (one subkey each)."""
    return f"swarmrl/v1/audits/{job_id}"


@dataclass(frozen=True)
class PublishedReport:
    """A verified report from the DHT: the report, and the envelope it came in (re-checkable)."""

    report: pb.AuditReport
    envelope: pb.Signed


def publish_report(dht: hivemind.DHT, envelope: pb.Signed, ttl_s: float = AUDIT_TTL_S) -> bool:
    """Store the signed report `envelope` under its job's key and its auditor's subkey; returns
    whether the DHT stored it.

    Raises:
        signing.SignatureError: the envelope is not a valid audit-report signature.
        ValueError: the report names another auditor than its signer.
    """
    report, signer = signing.open_signed(envelope, signing.AUDIT_REPORT, pb.AuditReport)
    if report.auditor_id != signer:
        raise ValueError(f"the report names auditor {report.auditor_id[:16]!r}, signed by {signer[:16]}")
    return bool(dht.store(audits_key(report.job_id), envelope.SerializeToString(),
                          expiration_time=get_dht_time() + ttl_s, subkey=signer))


def published_reports(dht: hivemind.DHT, job_id: str) -> list[PublishedReport]:
    """Every auditor's verified report of `job_id`, newest first (bad entries are logged, dropped)."""
    out = []
    for subkey, report, signer, envelope in signed_entries(dht, audits_key(job_id), signing.AUDIT_REPORT,
                                                           pb.AuditReport, "audit report", logging.INFO):
        if subkey != signer or report.auditor_id != signer or report.job_id != job_id:
            log.info("dropping audit report %s: signer %s, auditor %s, job %s", subkey[:16], signer[:16],
                     report.auditor_id[:16], report.job_id[:16])
            continue
        out.append(PublishedReport(report, envelope))
    return sorted(out, key=lambda p: -int(p.report.created_ms))
