"""What `swarmrl status` shows of one job: a `JobStatus` built from the job's ledger and head, and
(with a DHT) how many announcing workers can serve it (`swarm.env_records`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from swarmrl.node.swarm.env_records import cached_worker_envs, serving
from swarmrl.node.swarm.holders import find_holders
from swarmrl.protocol.pb import swarm_pb2 as pb

if TYPE_CHECKING:
    import hivemind

    from swarmrl.node.trainer.job import JobRuntime
    from swarmrl.node.trainer.ledger import Ledger
    from swarmrl.protocol.jobspec import JobSpec

log = logging.getLogger(__name__)

CORE_FIELDS = ("step", "policy_version", "reward_mean", "groups_trained", "groups_rejected", "staleness_mean",
               "loss", "seconds")


def job_status(job: JobRuntime, history: int, verdicts: int = 0, holders: bool = False) -> pb.JobStatus:
    """The job's status with its last `history` step rows (0: none), its newest `verdicts`
    validator verdicts and, with `holders`, who announces which delta version (a DHT read)."""
    ledger, job_id = job.ledger, job.job_id
    st = pb.JobStatus(
        job_id=job_id, state="done" if job.done else "running", policy_version=job.version,
        step=job.version, total_steps=job.spec.steps, adapter_hash=job.head_hash,
        trainer_id=job.identity.peer_id, groups_on_probation=job.groups_on_probation(),
        spec_json=job.spec.canonical_json(),
        adapter_bytes=sum(t.numel() * 4 for t in job.head_state.values()),
    )
    with job.lock:
        st.upload_bytes.update(job.upload_bytes)
    st.delta_bytes.extend(job.store.delta_sizes(job.version))
    if job.cotraining is not None:
        job.cotraining.swarm.fill_status(st)
    fill_from_ledger(st, ledger, job_id, history)
    with job.admission.gate:
        st.refused.update(job.admission.refused)
        sig = job.admission.signal
        st.tokens_admitted, st.tokens_zero_variance, st.prompts_skipped = sig.tokens, sig.tokens_zero_variance, \
            sig.skipped
    st.peers.extend(peer_infos(job))
    if verdicts:
        st.recent_verdicts.extend(ledger.recent_verdicts(job_id, min(verdicts, 1000)))
    if holders and job.cotraining is not None:
        st.holder_versions.update(holder_versions(job.cotraining.swarm.dht, job_id))
    if job.cotraining is not None:
        fill_serving(st, job.spec, job.cotraining.swarm.dht)
    return st


def fill_from_ledger(st: pb.JobStatus, ledger: Ledger, job_id: str, history: int) -> None:
    """Set the figures `st` takes from the ledger alone (groups admitted, dropped and rejected,
    validator verdicts, the last `history` step rows; 0: none): a running trainer's status, and
    what an interrupted `swarmrl up` reads from a stopped trainer's state folder."""
    counts = ledger.group_counts(job_id)
    checked, failed = ledger.verdict_counts(job_id)
    st.groups_admitted, st.groups_dropped = sum(counts.values()), counts.get("dropped", 0)
    st.groups_trained, st.groups_no_signal = counts.get("trained", 0), counts.get("no_signal", 0)
    st.validator_checked, st.validator_failed = checked, failed
    st.groups_dropped_banned = ledger.dropped_banned(job_id)
    st.groups_rejected.update(ledger.rejection_counts(job_id))
    for row in ledger.steps(job_id)[-history:] if history else []:
        st.history.append(step_metrics(row))


def fill_serving(st: pb.JobStatus, spec: JobSpec, dht: hivemind.DHT, max_age_s: float = 5.0) -> None:
    """Set `serving_workers` and `unserved_reason` from the workers' environment records (a DHT read,
    reused for `max_age_s` seconds); a DHT failure leaves them unset."""
    try:
        records = cached_worker_envs(dht, max_age_s)
    except Exception as exc:  # noqa: BLE001 - the DHT can fail: status still answers
        log.warning("reading the workers' environment records failed: %r", exc)
        return
    found = serving(spec, records)
    st.serving_workers, st.unserved_reason = found.workers, found.reason


def holder_versions(dht: hivemind.DHT, job_id: str) -> dict[str, int]:
    """Delta gossip: holder peer id -> the newest version it announces holding."""
    out: dict[str, int] = {}
    for (version, _), holders in find_holders(dht, job_id).items():
        for h in holders:
            out[h.holder_id] = max(out.get(h.holder_id, 0), version)
    return out


def peer_infos(job: JobRuntime) -> list[pb.PeerInfo]:
    """Per-peer figures; reputation = (passed + 1) / (verdicts + 2) over the verdicts received
    (the validator's Laplace score, without its soft flags)."""
    ledger, job_id, bans = job.ledger, job.job_id, job.admission.bans
    rejected = ledger.peer_rejections(job_id)
    states: Mapping[str, Mapping[str, int]] = ledger.peer_state_counts(job_id)  # peer -> state -> groups
    admitted = {p: sum(by_state.values()) for p, by_state in states.items()}
    verdicts = ledger.peer_verdict_counts(job_id)
    first = ledger.peer_first_seen(job_id)
    ids = sorted((set(admitted) | set(rejected) | set(bans.banned)) - {"unknown"})
    out = []
    for p in ids:
        checked, failed = verdicts.get(p, (0, 0))
        out.append(pb.PeerInfo(
            peer_id=p, groups_admitted=admitted.get(p, 0), groups_rejected=sum(rejected.get(p, {}).values()),
            reputation=(checked - failed + 1) / (checked + 2), banned=p in bans.banned,
            ban_reason=bans.banned.get(p, ""), banned_at_ms=bans.banned_at.get(p, 0), first_seen_ms=first.get(p, 0),
            groups_trained=states.get(p, {}).get("trained", 0), groups_dropped=states.get(p, {}).get("dropped", 0),
            groups_no_signal=states.get(p, {}).get("no_signal", 0),
            rejected_by_reason=dict(rejected.get(p, {})), verdicts_checked=checked, verdicts_failed=failed,
            strikes=bans.strikes.get(p, 0), adapter_version=job.admission.peer_versions.get(p)))
    return out


def step_metrics(row: dict[str, float]) -> pb.StepMetrics:
    """One metrics row (ledger) as the wire's StepMetrics; fields beyond the core go to `extra`."""
    m = pb.StepMetrics(
        step=int(row["step"]), policy_version=int(row["policy_version"]), reward_mean=row["reward_mean"],
        groups_trained=int(row.get("groups_trained", row.get("groups_admitted", 0))),  # older ledgers
        groups_rejected=int(row["groups_rejected"]),
        staleness_mean=row["staleness_mean"], loss=row["loss"], seconds=row["seconds"],
    )
    m.extra.update({k: float(v) for k, v in row.items() if k not in CORE_FIELDS and not math.isnan(float(v))})
    return m
