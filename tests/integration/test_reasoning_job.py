"""End to end on a reasoning-gym job with 256-token completions: `swarmrl up JOB.toml --model tiny`
(real processes on loopback: trainer, two workers, validator) trains 3 steps of `chain_sum` in the
reasoning format; workers and the validator build the same prompts from (seed, index) and grade with
reasoning-gym's scorer in the sandboxed pool; then `swarmrl eval JOB.toml --adapter` scores held-out
prompts. The tiny random model writes no answer tags, so nearly every completion runs to the length
limit: the run exercises truncation (reward 0, never more) at the full 256 tokens."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "tests/fixtures/jobs/rg_chain_sum_tiny.toml"


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_up_trains_a_reasoning_gym_job_with_long_completions(tmp_path: Path, model_cache: Path) -> None:
    run = tmp_path / "run"
    up = _run(["-m", "swarmrl.node.cli.main", "up", str(JOB), "--model", "tiny", "--workers", "2", "--out", str(run),
               "--cache-dir", str(model_cache), "--timeout", "900", "--no-eval"], 1200)
    if up.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (run / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up failed ({up.returncode}):\n{up.stderr[-3000:]}\n{logs}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["environment"].startswith("reasoning_gym:") and summary["steps"] == 3
    assert summary["groups_admitted"] > 0 and not summary["groups_rejected"]
    assert summary["adapter_hash_agreement"] and summary["serving_workers"] == 2
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert all(0.0 <= float(r["reward_mean"]) <= 1.1 for r in rows)
    checks = summary.get("validator", {})
    assert not checks.get("failed"), checks
    ev = _run(["-m", "swarmrl.node.cli.main", "eval", str(JOB), "--adapter", str(run / "adapter"), "--n", "8",
               "--cache-dir", str(model_cache)], 600)
    assert ev.returncode == 0, ev.stderr
    scores = json.loads(ev.stdout.strip().splitlines()[-1])
    assert scores["n"] == 8 and 0.0 <= scores["adapter_reward"] <= 1.1
