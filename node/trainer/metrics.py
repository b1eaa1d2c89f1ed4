"""The trainer's Prometheus metrics, read from its jobs and ledger at scrape time (no counters in
the admission or step paths): groups admitted / rejected by reason / pending / on probation,
steps, step time, reward, ESS, staleness, adapter bytes served, bans, validator verdicts, calls
refused by rate limits, averaging round members refused; and the gRPC server's streams (active,
refused, ended)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from swarmrl.node.net.grpc_guard import STREAM_ENDINGS, STREAM_REFUSALS
from swarmrl.node.net.rate_limits import RATE_LIMITED_ADDRESS, RATE_LIMITED_PEER
from swarmrl.node.ops.metrics import Families, with_known

if TYPE_CHECKING:
    from swarmrl.node.trainer.hosting import Trainer
    from swarmrl.node.trainer.job import JobRuntime

P = "swarmrl_trainer_"
LAST_STEP = {  # metrics row key -> (gauge, help)
    "reward_mean": ("reward", "mean reward of the last step's batch"),
    "ess": ("ess_ratio", "effective sample size of the last step's importance ratios, as a share of the batch (0..1)"),
    "staleness_mean": ("staleness_versions", "mean staleness of the last step's rollouts (policy versions)"),
    "loss": ("loss", "loss of the last step"),
    "seconds": ("step_seconds", "wall time of the last step (batch, learner step, publish, checkpoint)"),
}
GROUP_STATES = {  # ledger state of consumed groups -> the help of its counter, groups_<state>_total
    "trained": "admitted groups trained into a published version",
    "no_signal": "admitted groups consumed by a batch with no learning signal (all-equal rewards; no version made)",
    "dropped": "admitted groups dropped (ban, staleness)",
}


def trainer_metrics(trainer: Trainer) -> Iterator[Metric]:
    """Every job's families, plus the process-wide ones."""
    f = Families()
    f.counter(P + "unrouted_batches_total", "rollout batches naming no job hosted here", {},
              trainer.unrouted_rejections)
    guard = trainer.grpc_guard
    if guard is not None:
        f.gauge(P + "grpc_streams_active", "gRPC streams being served now", {}, guard.active())
        for reason, n in with_known(guard.refused, STREAM_REFUSALS):
            f.counter(P + "grpc_streams_refused_total", "gRPC streams refused over a bound (total, per_peer, per_address)",
                      {"reason": reason}, n)
        for reason, n in with_known(guard.reaped, STREAM_ENDINGS):
            f.counter(P + "grpc_streams_ended_total", "gRPC streams ended by the server (deadline, idle)",
                      {"reason": reason}, n)
    for job in list(trainer.jobs.values()):
        job_families(f, job)
    yield from f


def job_families(f: Families, job: JobRuntime) -> None:
    """One job's samples (label `job_id`)."""
    j = {"job_id": job.job_id}
    ledger, job_id = job.ledger, job.job_id
    counts = ledger.group_counts(job_id)
    f.counter(P + "groups_admitted_total", "groups admitted (committed to the ledger)", j, sum(counts.values()))
    for state, doc in GROUP_STATES.items():
        f.counter(P + f"groups_{state}_total", doc, j, counts.get(state, 0))
    f.gauge(P + "groups_pending", "admitted groups waiting for a step", j, counts.get("pending", 0))
    f.gauge(P + "groups_on_probation", "pending groups held until their peer's first passing verdict", j,
            job.groups_on_probation())
    for reason, n in sorted(ledger.rejection_counts(job_id).items()):
        f.counter(P + "groups_rejected_total", "groups rejected at admission, by reason", {**j, "reason": reason}, n)
    f.gauge(P + "policy_version", "head adapter version (= steps taken)", j, job.version)
    f.gauge(P + "job_done", "1 once the job took all its steps", j, float(job.done))
    _step_families(f, j, ledger.steps(job_id))
    with job.lock:
        uploads = dict(job.upload_bytes)
    for requester, n in sorted(uploads.items()):
        f.counter(P + "adapter_served_bytes_total", "adapter payload bytes served over gRPC, by requester kind",
                  {**j, "requester": requester}, n)
    f.gauge(P + "banned_peers", "peers banned from the job now", j, len(job.admission.banned))
    with job.admission.gate:
        refused = dict(job.admission.refused)
        sig = job.admission.signal
        tokens, flat, skipped = sig.tokens, sig.tokens_zero_variance, sig.skipped
    f.counter(P + "tokens_admitted_total", "completion tokens of the admitted groups, this run", j, tokens)
    f.counter(P + "tokens_zero_variance_total", "completion tokens admitted in groups with all-equal rewards "
              "(no learning signal), this run", j, flat)
    f.counter(P + "prompts_skipped_total", "new prompt indices passed over by lease_filter = \"signal\" "
              "(their prompt's last group had no signal), this run", j, skipped)
    for reason, n in with_known(refused, (RATE_LIMITED_PEER, RATE_LIMITED_ADDRESS)):
        f.counter(P + "calls_refused_total", "lease and submit calls refused before admission (rate limits), by reason",
                  {**j, "reason": reason}, n)
    if job.cotraining is not None:
        for reason, n in sorted(job.cotraining.swarm.refused_counts().items()):
            f.counter(P + "averaging_refused_total", "members left out of averaging rounds with cotrainers "
                      "(round tickets, bad payloads), by reason", {**j, "reason": reason}, n)
    checked, failed = ledger.verdict_counts(job_id)
    f.counter(P + "verdicts_total", "validator verdicts received, by result", {**j, "result": "passed"}, checked - failed)
    f.counter(P + "verdicts_total", "validator verdicts received, by result", {**j, "result": "failed"}, failed)


def _step_families(f: Families, j: dict[str, str], rows: list[dict[str, Any]]) -> None:
    f.counter(P + "steps_total", "steps taken (versions published)", j, len(rows))
    f.counter(P + "step_seconds_total", "wall time spent in steps", j, sum(float(r.get("seconds", 0.0)) for r in rows))
    if not rows:
        return
    last = rows[-1]
    for key, (name, doc) in LAST_STEP.items():
        v = last.get(key)
        if v is not None and math.isfinite(float(v)):
            f.gauge(P + name, doc, j, float(v))
