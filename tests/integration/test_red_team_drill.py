"""The red-team drill end to end: `swarmrl up --model tiny --steps 8 --red-team <every mode>` as real
processes on loopback (bootstrap, trainer, validator, 2 honest workers, one adversarial worker per
mode). Every mode must be detected and banned, no honest worker banned, and the trainer's summary
must count what the bans dropped."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from swarmrl.node.worker.red_team import MODES

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 8


@pytest.fixture(scope="module")
def summary(tmp_path_factory, model_cache) -> dict:
    out = tmp_path_factory.mktemp("drill")
    proc = subprocess.run(
        [sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--steps", str(STEPS), "--workers", "2",
         "--red-team", ",".join(MODES), "--out", str(out), "--cache-dir", str(model_cache), "--timeout", "900", "--no-eval"],
        capture_output=True, text=True, timeout=1200, check=False,
    )
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (out / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up --red-team failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    return json.loads((out / "summary.json").read_text())


def test_every_mode_is_detected_and_banned(summary: dict) -> None:
    table = summary["red_team"]
    assert set(table) == set(MODES)
    for mode, row in table.items():
        assert row["submitted"] > 0, (mode, row)
        assert row["detected"], (mode, row)
        assert row["banned"] and row["seconds_to_ban"] is not None and row["seconds_to_ban"] >= 0, (mode, row)


def test_no_honest_worker_is_banned_and_the_job_finishes(summary: dict) -> None:
    assert summary["honest_banned"] == 0
    assert summary["audit"]["honest_flagged"] == 0, summary["audit"]   # no honest worker credited for a cheat's work
    assert summary["steps"] == STEPS and summary["adapter_hash_agreement"] is True


def test_bans_drop_admitted_groups_and_count_them(summary: dict) -> None:
    admitted_by_adversaries = sum(r["admitted_before_ban"] - r["trained"] for r in summary["red_team"].values())
    assert summary["groups_dropped_banned"] <= summary["groups_dropped"]
    assert summary["groups_dropped_banned"] <= admitted_by_adversaries
