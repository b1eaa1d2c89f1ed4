"""End to end on a data-set job: the arithmetic task exported as JSONL (scripts/export_arithmetic.py),
`swarmrl up JOB.toml --model tiny` for 2 steps (real processes on loopback), workers fetch the
file by content address, then `swarmrl eval JOB.toml --adapter` scores the held-out rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
STEPS = 2
ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_up_trains_a_jsonl_job_and_eval_scores_it(tmp_path: Path, model_cache: Path) -> None:
    job_dir = tmp_path / "job"
    out = _run([str(ROOT / "scripts" / "export_arithmetic.py"), str(job_dir), "--steps", str(STEPS)], 60)
    assert out.returncode == 0, out.stderr
    run = tmp_path / "run"
    up = _run(["-m", "swarmrl.node.cli.main", "up", str(job_dir / "arithmetic.toml"), "--model", "tiny", "--workers", "2",
               "--out", str(run), "--cache-dir", str(model_cache), "--timeout", "600", "--no-eval"], 900)
    if up.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (run / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up failed ({up.returncode}):\n{up.stderr[-3000:]}\n{logs}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["environment"].startswith("dataset:") and summary["steps"] == STEPS
    assert summary["final_version"] >= 1 and summary["groups_admitted"] > 0 and not summary["groups_rejected"]
    assert summary["adapter_hash_agreement"]
    assert summary["serving_workers"] == 2   # both workers announced themselves in the DHT (env_records)
    for w in ("worker0", "worker1"):
        ready = json.loads((run / "run" / f"{w}.ready").read_text())
        assert not ready["skipped_jobs"] and not ready["dataset_refused"]
        assert sum(ready["dataset_sources"].values()) == 1   # fetched (or found cached) once, verified
    ev = _run(["-m", "swarmrl.node.cli.main", "eval", str(job_dir / "arithmetic.toml"), "--adapter", str(run / "adapter"),
               "--n", "16", "--cache-dir", str(model_cache)], 300)
    assert ev.returncode == 0, ev.stderr
    scores = json.loads(ev.stdout.strip().splitlines()[-1])
    assert scores["n"] == 16 and 0.0 <= scores["adapter_reward"] <= 1.1
