"""End to end on the multi-turn jobs: `swarmrl up tests/fixtures/jobs/{wordle,calculator,vf_guess}_tiny.toml
--model tiny` (3 steps, real processes on loopback) trains with the validator checking episodes, and
a forged_env_reply adversary on wordle is caught and banned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _up(job: str, out: Path, cache: Path, *extra: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "swarmrl.node.cli.main", "up", str(ROOT / "tests" / "fixtures" / "jobs" / job),
                          "--model", "tiny", "--out", str(out), "--cache-dir", str(cache), "--timeout", "600", "--no-eval", *extra],
                         capture_output=True, text=True, timeout=900, check=False)
    if run.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (out / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up {job} failed ({run.returncode}):\n{run.stderr[-3000:]}\n{logs}")
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("job", ["wordle_tiny.toml", "calculator_tiny.toml"])
def test_a_multiturn_job_trains_with_checked_episodes(job: str, tmp_path: Path, model_cache: Path) -> None:
    summary = _up(job, tmp_path / "run", model_cache)
    assert summary["steps"] == 3 and summary["final_version"] >= 1 and summary["adapter_hash_agreement"]
    assert summary["groups_admitted"] > 0 and not summary["groups_rejected"]
    assert summary["validator"]["checked"] > 0 and summary["validator"]["failed"] == 0


def test_forged_env_replies_are_caught_on_wordle(tmp_path: Path, model_cache: Path) -> None:
    summary = _up("wordle_tiny.toml", tmp_path / "drill", model_cache, "-j", "steps=8", "--red-team", "forged_env_reply")
    row = summary["red_team"]["forged_env_reply"]
    assert row["banned"] and summary["honest_banned"] == 0, row


def test_a_verifiers_multiturn_job_trains_with_checked_episodes(tmp_path: Path, model_cache: Path,
                                                                vf_guess_site: Path) -> None:
    """tests/fixtures/vf_guess (a verifiers MultiTurnEnv, pip-installed) through the adapter: workers
    play it, the validator replays every environment reply with verifiers' env_response."""
    summary = _up("vf_guess_tiny.toml", tmp_path / "run", model_cache)
    assert summary["steps"] == 3 and summary["final_version"] >= 1 and summary["adapter_hash_agreement"]
    assert summary["groups_admitted"] > 0 and not summary["groups_rejected"]
    assert summary["validator"]["checked"] > 0 and summary["validator"]["failed"] == 0
