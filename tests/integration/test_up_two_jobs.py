"""`swarmrl up --model tiny --jobs 2` (issue 24 item 6): one swarm, two jobs on one base model,
real processes on 127.0.0.1 (bootstrap, a trainer per job, one validator, two shared workers).
Both jobs reach their steps and train, each job's files are in its own folder, the run's summary
gives each job's figures and each worker's split, and the split adds up to the trainers' counts. Each job's
credit books are audited with every worker's receipts: no finding.
Whether each worker served *both* jobs is not asserted (the market keeps a worker on its job
while the job's trainer grants leases: test_two_jobs.py says why)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]   # 128 s in one run beside a Gemma `up` on 2 cores
STEPS = 3


def test_up_runs_two_jobs_on_shared_workers(tmp_path: Path, model_cache: Path) -> None:
    out = tmp_path / "up"
    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--jobs", "2", "--weights", "1,2",
         "--steps", str(STEPS), "--workers", "2", "--out", str(out), "--cache-dir", str(model_cache),
         "--timeout", "400", "--no-eval"], capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (out / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n{logs}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["every_job_trained"] is True and list(summary["jobs"]) == ["builtin-0", "builtin-1"]
    assert summary["trainers"] == {"trainer": ["builtin-0"], "trainer1": ["builtin-1"]}
    for name, job in summary["jobs"].items():
        folder = out / "jobs" / name
        one = json.loads((folder / "summary.json").read_text())
        assert (job["steps"], job["final_version"], one["steps"]) == (STEPS, STEPS, STEPS)
        assert job["groups_trained"] > 0 and job["adapter_hash_agreement"] is True
        audit = job["audit"]   # each job's credit books, audited with every worker's receipts
        assert (audit["findings"], audit["honest_flagged"], audit["statements"]) == (0, 0, STEPS), audit
        assert one["audit"] == audit
        credit = job["credit"]   # each job's leaderboard: what its statements credit, every batch verified
        with open(folder / "metrics.csv") as f:
            trained = sum(int(r["groups_trained"]) for r in csv.DictReader(f))
        assert credit["findings"] == {} and credit["groups"] == trained > 0 and one["credit"] == credit, credit
        # a worker the market kept on the other job may be listed with only dropped groups (none
        # trained, none checked: no verified share); every credited group was checked and verified
        assert set(credit["peers"]) <= {"worker0", "worker1"} and all(
            p["verified_share"] == (1.0 if p["groups"] else None) for p in credit["peers"].values()), credit
        assert job["adapter"] == str(folder / "adapter") and (folder / "adapter" / "adapter_config.json").is_file()
        assert (folder / "metrics.csv").is_file() and one["job_id"] == job["job_id"]
        assert sum(summary["worker_split"][w][name] for w in ("worker0", "worker1")) == job["groups_admitted"]
        assert one["groups_admitted_by_worker"] == {w: s[name] for w, s in summary["worker_split"].items()}
    assert [j["weight"] for j in summary["jobs"].values()] == [1.0, 2.0]
    assert summary["jobs"]["builtin-0"]["job_id"] != summary["jobs"]["builtin-1"]["job_id"]   # seeds differ
    assert all(sum(split.values()) > 0 for split in summary["worker_split"].values())   # every worker served
    assert "swarmrl up: jobs" in proc.stdout and "each worker's groups admitted" in proc.stdout
    assert "swarmrl status --initial-peers" in proc.stderr
    endpoints = json.loads((out / "run" / "endpoints.json").read_text())
    assert set(endpoints["dashboard"]) == {"builtin-0", "builtin-1"}
