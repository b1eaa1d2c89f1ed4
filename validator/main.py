"""The validator process: find jobs in the DHT, spot-check their admitted rollouts, report verdicts.

Main loop: find jobs -> (audit mode, when due: audit each job's credit books, publish the signed
reports, mirror the chains that verified) -> for each: sample admitted batches -> ladder of checks -> sign verdicts -> report to
the trainer -> update reputation.
"""

from __future__ import annotations

import logging

from swarmrl.node.ops.metrics import metrics_urls, start_metrics
from swarmrl.node.runtime.config import ValidatorConfig
from swarmrl.node.runtime.lifecycle import start_role, write_ready
from swarmrl.node.runtime.preflight import preflight
from swarmrl.node.swarm.audit_records import publish_report
from swarmrl.node.swarm.dht import find_jobs, join_swarm
from swarmrl.validator.audits import AuditMode
from swarmrl.validator.metrics import validator_metrics
from swarmrl.validator.mirror import ChainMirror
from swarmrl.validator.service import ValidatorService

log = logging.getLogger(__name__)


def run(cfg: ValidatorConfig) -> None:
    """Start the validator and validate until SIGTERM / SIGINT."""
    preflight(cfg)   # what --dry-run checks: its DHT and /metrics ports
    stop, identity = start_role("validator", cfg.key, cfg.threads)
    dht = join_swarm(cfg.net)
    service = ValidatorService(cfg, identity)
    mirror = None
    if cfg.audit_every_s > 0:   # audit mode: the jobs' credit books every audit_every_s, reports in the DHT
        if cfg.audit_mirror:    # the chains that verified, served peer to peer
            mirror = ChainMirror(dht, identity, dialable=not cfg.net.client_mode)
        service.audits = AuditMode(identity, cfg.audit_every_s, sample=cfg.audit_sample, recheck_for=service.recheck_for,
                                   publish=(lambda signed: publish_report(dht, signed)) if cfg.audit_publish else None,
                                   mirror=mirror)
    ops = start_metrics(cfg.metrics_host, cfg.metrics_port, lambda: validator_metrics(service))
    write_ready(cfg.ready_file, {"peer_id": identity.peer_id, **metrics_urls(ops)})
    log.info("validator %s started", identity.peer_id)
    try:
        while not stop.is_set():
            records = find_jobs(dht)
            if service.audits is not None and service.audits.due():
                service.audits.run(records, stop)
            if mirror is not None:
                mirror.refresh()
            if not service.poll(records, stop):
                stop.wait(cfg.poll_s)
    finally:
        if ops is not None:
            ops.close()
        service.close()
        if mirror is not None:
            mirror.shutdown()
        dht.shutdown()
