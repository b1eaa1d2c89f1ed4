"""Each role's Prometheus families, read from state at scrape time: names follow the
conventions (swarmrl_ prefix, counters end in _total, base units) and the values are the role's
own figures. Fakes stand in for the roles; the trainer's come from a real ledger."""

from __future__ import annotations

import threading
from collections import Counter
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarmrl.node.ops.metrics import registry_of
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.metrics import trainer_metrics
from swarmrl.node.worker.metrics import worker_metrics
from swarmrl.node.worker.stats import SessionStats
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.validator.metrics import validator_metrics
from swarmrl.validator.stats import CheckStats, VerdictStats


def _scrape(fn) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry_of(fn)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("swarmrl_"), fam.name
        for s in fam.samples:
            if fam.type == "counter":
                assert s.name.endswith("_total") or s.name.endswith("_created"), s.name
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_trainer_metrics_read_the_ledger(tmp_path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    try:
        ledger.reject("j1", "w1", "stale", 1000, count=3)
        ledger.record_step("j1", 1, {"step": 1.0, "reward_mean": 0.5, "ess": 0.8, "staleness_mean": 0.25,
                                     "loss": 0.1, "seconds": 2.0})
        job = SimpleNamespace(job_id="j1", ledger=ledger, version=1, done=False, lock=threading.RLock(),
                              upload_bytes=Counter({"worker": 100}), groups_on_probation=lambda: 2,
                              admission=SimpleNamespace(banned={"w9": "logprob"}, gate=threading.RLock(),
                                                        refused=Counter({"rate_limited_peer": 2}),
                                                        signal=SimpleNamespace(tokens=50, tokens_zero_variance=20,
                                                                               skipped=3)),
                              cotraining=SimpleNamespace(swarm=SimpleNamespace(
                                  refused_counts=lambda: {"bad_signature": 3})))
        guard = SimpleNamespace(active=lambda: 3, refused=Counter({"per_peer": 5}), reaped=Counter({"idle": 1}))
        got = _scrape(lambda: trainer_metrics(SimpleNamespace(jobs={"j1": job}, unrouted_rejections=4,
                                                              grpc_guard=guard)))
    finally:
        ledger.close()
    j = (("job_id", "j1"),)
    assert got[("swarmrl_trainer_groups_rejected_total", (("job_id", "j1"), ("reason", "stale")))] == 3
    assert got[("swarmrl_trainer_steps_total", j)] == 1
    assert got[("swarmrl_trainer_step_seconds_total", j)] == 2.0
    assert got[("swarmrl_trainer_reward", j)] == 0.5 and got[("swarmrl_trainer_ess_ratio", j)] == 0.8
    assert got[("swarmrl_trainer_staleness_versions", j)] == 0.25
    assert got[("swarmrl_trainer_groups_on_probation", j)] == 2
    assert got[("swarmrl_trainer_banned_peers", j)] == 1
    assert got[("swarmrl_trainer_adapter_served_bytes_total", (("job_id", "j1"), ("requester", "worker")))] == 100
    assert got[("swarmrl_trainer_unrouted_batches_total", ())] == 4
    assert got[("swarmrl_trainer_calls_refused_total", (("job_id", "j1"), ("reason", "rate_limited_peer")))] == 2
    assert got[("swarmrl_trainer_tokens_zero_variance_total", j)] == 20
    assert got[("swarmrl_trainer_prompts_skipped_total", j)] == 3
    assert got[("swarmrl_trainer_averaging_refused_total", (("job_id", "j1"), ("reason", "bad_signature")))] == 3
    assert got[("swarmrl_trainer_grpc_streams_active", ())] == 3
    assert got[("swarmrl_trainer_grpc_streams_refused_total", (("reason", "per_peer"),))] == 5
    assert got[("swarmrl_trainer_grpc_streams_ended_total", (("reason", "idle"),))] == 1


def test_worker_metrics_read_the_sessions() -> None:
    stats = SessionStats()
    stats.generated(completions=8, tokens=400, seconds=2.0)
    stats.groups_refused.update(["stale", "stale"])
    stats.leases_refused["busy"] += 1
    stats.caught_up(0.5)
    session = SimpleNamespace(stats=stats, record=pb.JobRecord(head_version=5), replica=SimpleNamespace(version=3),
                              sync=SimpleNamespace(stats=_sync(bytes_from_peers=10, bytes_from_trainer=20, rejected=1,
                                                                               snapshot_bytes={"peer": 7, "trainer": 3},
                                                                               snapshot_refused={"adapter_hash": 2}),
                                                   gossip=None))
    got = _scrape(lambda: worker_metrics({"j1": session}, {}))
    j = (("job_id", "j1"),)
    assert got[("swarmrl_worker_generated_tokens_total", j)] == 400
    assert got[("swarmrl_worker_tokens_per_second", j)] == 200
    assert got[("swarmrl_worker_rollouts_generated_total", j)] == 8
    assert got[("swarmrl_worker_groups_refused_total", (("job_id", "j1"), ("reason", "stale")))] == 2
    assert got[("swarmrl_worker_leases_refused_total", (("job_id", "j1"), ("reason", "busy")))] == 1
    assert got[("swarmrl_worker_adapter_version_lag", j)] == 2
    assert got[("swarmrl_worker_adapter_catchup_seconds_total", j)] == 0.5
    assert got[("swarmrl_worker_adapter_received_bytes_total", (("job_id", "j1"), ("source", "peer")))] == 10
    assert got[("swarmrl_worker_adapter_deltas_rejected_total", j)] == 1
    assert got[("swarmrl_worker_snapshot_fetched_bytes_total", (("job_id", "j1"), ("source", "peer")))] == 7
    assert got[("swarmrl_worker_snapshot_fetched_bytes_total", (("job_id", "j1"), ("source", "trainer")))] == 3
    assert got[("swarmrl_worker_snapshot_refused_total", (("job_id", "j1"), ("reason", "adapter_hash")))] == 2
    assert got[("swarmrl_worker_snapshot_refused_total", (("job_id", "j1"), ("reason", "busy")))] == 0
    assert got[("swarmrl_worker_snapshot_served_bytes_total", j)] == 0


def _sync(**counts: object) -> object:
    """A worker session's real catch-up counters (`catchup.SyncStats`) with `counts` set."""
    from swarmrl.node.swarm.catchup import SyncStats

    return SyncStats(**counts)  # type: ignore[arg-type]


def test_validator_metrics_read_the_tallies() -> None:
    stats = VerdictStats()
    stats.groups["j1"] += 4
    stats.sent("j1", [pb.Verdict(check="all", passed=True), pb.Verdict(check="logprob", passed=False)])
    rungs = CheckStats()
    rungs.groups["regrade"] += 2
    rungs.seconds["regrade"] += 0.3
    service = SimpleNamespace(stats=stats, validators={"sha": SimpleNamespace(stats=rungs)},
                              reputation=SimpleNamespace(peers=list), audits=None)
    got = _scrape(lambda: validator_metrics(service))
    assert got[("swarmrl_validator_groups_checked_total", (("job_id", "j1"),))] == 4
    assert got[("swarmrl_validator_verdicts_total", (("check", "logprob"), ("job_id", "j1"), ("result", "failed")))] == 1
    assert got[("swarmrl_validator_check_seconds_total", (("check", "regrade"),))] == 0.3
    assert got[("swarmrl_validator_check_groups_total", (("check", "regrade"),))] == 2
    assert not any(name.startswith("swarmrl_validator_audit") for name, _ in got)   # audit mode off: no series

    # audit mode (validator/audits.py): audits by result from the first scrape, findings by reason
    from collections import Counter

    service.audits = SimpleNamespace(counts=Counter(clean=3, findings=1), findings=Counter(failed_recheck=2),
                                     published=4)
    got = _scrape(lambda: validator_metrics(service))
    assert got[("swarmrl_validator_audits_total", (("result", "clean"),))] == 3
    assert got[("swarmrl_validator_audits_total", (("result", "unreachable"),))] == 0
    assert got[("swarmrl_validator_audit_findings_total", (("reason", "failed_recheck"),))] == 2
    assert got[("swarmrl_validator_audit_reports_published_total", ())] == 4


def test_a_fresh_worker_exposes_its_series_before_any_job(model_cache, tmp_path) -> None:
    """A worker's /metrics had no swarmrl_ series for its first seconds (issue 28 item 5): a real
    worker, before it has found a job, exposes its job and data-set series at 0; a fresh job
    session its drop reasons."""
    from swarmrl.node.runtime.config import WorkerConfig
    from swarmrl.node.worker.main import Worker
    from swarmrl.protocol.identity import Identity

    worker = Worker(WorkerConfig(base_model="tiny", cache_dir=model_cache, key=tmp_path / "w.key"),
                    Identity.from_seed(b"w" * 32))
    try:
        got = _scrape(worker.metrics)   # what run() serves at /metrics
    finally:
        worker.close()
    assert got[("swarmrl_worker_jobs_active", ())] == 0 and got[("swarmrl_worker_jobs_finished", ())] == 0
    assert got[("swarmrl_worker_jobs_skipped", ())] == 0
    for source in ("cache", "peer", "trainer"):
        assert got[("swarmrl_worker_dataset_fetches_total", (("source", source),))] == 0
    assert got[("swarmrl_worker_dataset_transfers_refused_total", ())] == 0
    session = SimpleNamespace(stats=SessionStats(), record=pb.JobRecord(), replica=SimpleNamespace(version=0),
                              sync=SimpleNamespace(stats=_sync(), gossip=None))
    fresh = _scrape(lambda: worker_metrics({"j1": session}, {}))
    assert fresh[("swarmrl_worker_groups_dropped_total", (("job_id", "j1"), ("reason", "nonfinite_logprobs")))] == 0


def test_a_fresh_trainer_exposes_its_labelled_series_at_zero() -> None:
    """A real stream guard that refused nothing yet: every bound and ending is a series at 0."""
    from swarmrl.node.net.grpc_guard import StreamGuard
    from swarmrl.node.runtime.limits import GrpcLimits

    guard = StreamGuard(GrpcLimits())
    try:
        got = _scrape(lambda: trainer_metrics(SimpleNamespace(jobs={}, unrouted_rejections=0, grpc_guard=guard)))
    finally:
        guard.close()
    for reason in ("total", "per_peer", "per_address"):
        assert got[("swarmrl_trainer_grpc_streams_refused_total", (("reason", reason),))] == 0
    for reason in ("deadline", "idle"):
        assert got[("swarmrl_trainer_grpc_streams_ended_total", (("reason", reason),))] == 0
