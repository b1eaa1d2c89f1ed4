"""A worker's Prometheus metrics, read from its job sessions at scrape time: tokens/s, rollouts
generated, graded, submitted, refused by reason, receipts kept and refused, adapter catch-up latency,
version lag, adapter bytes from peers vs the trainer, snapshot bytes fetched by source, served and
refused; and, from the start, before any job: jobs
active, finished and skipped, and data-set fetches by source.

A labelled series the role knows the labels of is exposed at 0 from the start (`with_known`),
so a fresh worker's /metrics is not empty and a rate() has a first sample (issue 28 item 5)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from swarmrl.node.ops.metrics import Families, with_known
from swarmrl.node.swarm.catchup import SyncStats
from swarmrl.node.swarm.datasets import DatasetFetchStats
from swarmrl.node.swarm.gossip import GossipNode
from swarmrl.protocol.receipts import REASONS as RECEIPT_REASONS
from swarmrl.protocol.snapshot_sources import REFUSALS, SOURCES

if TYPE_CHECKING:
    from swarmrl.node.worker.session import JobSession

P = "swarmrl_worker_"


DROP_REASONS = ("nonfinite_logprobs",)
"""Why a worker drops a generated group unsigned (`JobSession`): exposed at 0 from a job's start."""
DATASET_SOURCES = ("cache", "peer", "trainer")
"""Where a data set can come from (`swarm.datasets.fetch_dataset`): exposed at 0 from the start."""


def worker_metrics(live: Mapping[str, JobSession], retired: Mapping[str, SimpleNamespace],
                   skipped: Mapping[str, str] | None = None,
                   datasets: DatasetFetchStats | None = None) -> Iterator[Metric]:
    """The worker's metric families at scrape time, over its live and retired job sessions (job
    id -> session, or what `retired` kept of a finished one), the jobs it skipped (job id -> why)
    and its data-set fetches."""
    f = Families()
    f.gauge(P + "jobs_active", "jobs this worker has a live session for", {}, len(live))
    f.gauge(P + "jobs_finished", "jobs this worker worked on that are done", {}, len(retired))
    f.gauge(P + "jobs_skipped", "announced jobs this worker does not serve (model, environment, sampling)", {},
            len(skipped or {}))
    stats = datasets or DatasetFetchStats()
    for source, n in with_known(stats.sources, DATASET_SOURCES):
        f.counter(P + "dataset_fetches_total", "data sets obtained, by source", {"source": source}, n)
    f.counter(P + "dataset_transfers_refused_total", "data-set transfers whose bytes did not verify", {},
              sum(stats.refused.values()))
    sessions: dict[str, JobSession | SimpleNamespace] = {**retired, **live}
    for job_id, s in sessions.items():
        session_families(f, job_id, s)
    yield from f


def retired(session: JobSession) -> SimpleNamespace:
    """What the metrics still read of a finished job's session (its counters stay monotonic)."""
    return SimpleNamespace(stats=session.stats, record=session.record,
                           replica=SimpleNamespace(version=session.replica.version),
                           sync=SimpleNamespace(stats=session.sync.stats, gossip=session.sync.gossip))


def session_families(f: Families, job_id: str, session: JobSession | SimpleNamespace) -> None:
    """Add one job session's samples (tokens, rollouts, leases, catch-ups, version) to `f`; a
    finished job's session is its `retired` stand-in."""
    j, s = {"job_id": job_id}, session.stats
    f.counter(P + "generated_tokens_total", "completion tokens generated", j, s.tokens)
    f.counter(P + "generate_seconds_total", "wall time spent generating (tokens/s = rate of the two)", j,
              s.generate_seconds)
    f.gauge(P + "tokens_per_second", "generation throughput of the last lease", j, s.last_tokens_per_second)
    f.counter(P + "rollouts_generated_total", "completions sampled", j, s.rollouts_generated)
    f.counter(P + "rollouts_graded_total", "completions graded (failures included)", j, s.rollouts_graded)
    f.counter(P + "grade_failures_total", "completions whose grading failed", j, s.grade_failures)
    f.counter(P + "groups_submitted_total", "groups submitted to the trainer", j, s.groups_submitted)
    f.counter(P + "groups_admitted_total", "submitted groups the trainer admitted", j, s.groups_admitted)
    for reason, n in sorted(s.groups_refused.items()):
        f.counter(P + "groups_refused_total", "submitted groups the trainer refused, by reason",
                  {**j, "reason": reason}, n)
    for reason, n in with_known(s.groups_dropped, DROP_REASONS):
        f.counter(P + "groups_dropped_total", "groups generated but never signed, by reason", {**j, "reason": reason}, n)
    f.counter(P + "receipts_kept_total", "trainer-signed batch receipts verified and kept", j, s.receipts_kept)
    for reason, n in with_known(s.receipts_refused, RECEIPT_REASONS):
        f.counter(P + "receipts_refused_total", "batch receipts refused (forged, unsigned, not this batch), by reason",
                  {**j, "reason": reason}, n)
    f.counter(P + "engine_faults_total", "inference engine failures (each retried after recovery, or the lease skipped)",
              j, s.engine_faults)
    for reason, n in sorted(s.leases_refused.items()):
        f.counter(P + "leases_refused_total", "lease requests refused, by reason", {**j, "reason": reason}, n)
    f.counter(P + "adapter_catchups_total", "catch-ups that moved the adapter to a newer version", j, s.catchups)
    f.counter(P + "adapter_catchup_seconds_total", "wall time spent in those catch-ups", j, s.catchup_seconds)
    f.gauge(P + "adapter_catchup_last_seconds", "duration of the last catch-up that moved the adapter", j,
            s.last_catchup_seconds)
    head, held = int(session.record.head_version), session.replica.version
    f.gauge(P + "adapter_version", "adapter version held for the job", j, held)
    f.gauge(P + "adapter_version_lag", "head version announced by the trainer minus the version held", j,
            max(0, head - held))
    sync = session.sync.stats
    for source, n in (("peer", sync.bytes_from_peers), ("trainer", sync.bytes_from_trainer)):
        f.counter(P + "adapter_received_bytes_total", "adapter payload bytes received, by source",
                  {**j, "source": source}, n)
    f.counter(P + "adapter_deltas_rejected_total", "signed deltas whose payload was malformed (not applied)", j,
              sync.rejected)
    served = session.sync.gossip.served_bytes(job_id) if session.sync.gossip is not None else 0
    f.counter(P + "adapter_served_bytes_total", "adapter payload bytes this worker served to peers", j, served)
    snapshot_families(f, j, sync, session.sync.gossip)


def snapshot_families(f: Families, j: dict[str, str], sync: SyncStats, gossip: GossipNode | None) -> None:
    """Snapshot bytes fetched by source (peer, trainer), served to peers, and refused (a peer's
    that did not verify, by reason; requests this worker refused as busy), for one job `j`."""
    for source, n in with_known(sync.snapshot_bytes, SOURCES):
        f.counter(P + "snapshot_fetched_bytes_total", "adapter snapshot payload bytes received, by source",
                  {**j, "source": source}, n)
    f.counter(P + "snapshot_served_bytes_total", "adapter snapshot payload bytes this worker served to peers", j,
              gossip.snapshot_served_bytes(j["job_id"]) if gossip is not None else 0)
    refused = dict(sync.snapshot_refused)
    if gossip is not None:
        refused["busy"] = gossip.snapshot_refused[j["job_id"]]
    for reason, n in with_known(refused, REFUSALS):
        f.counter(P + "snapshot_refused_total", "adapter snapshots refused: a peer's that did not verify, or "
                  "requests this worker refused at its stream bound (busy), by reason", {**j, "reason": reason}, n)
