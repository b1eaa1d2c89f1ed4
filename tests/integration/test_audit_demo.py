"""scripts/demo_audit_mode.sh end to end, as its own processes on 127.0.0.1 (bootstrap, trainer,
worker, a validator in audit mode): the validator's audits are clean and published; the public
record is audited from the trainer's statements over libp2p; `--replay all` recomputes every
version from the credited groups; with the trainer stopped, the validator's mirror serves the
statements and the audit still adds up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 10


def test_the_audit_demo(tmp_path: Path, model_cache: Path) -> None:
    env = {**os.environ, "STEPS": str(STEPS), "SWARMRL_CACHE": str(model_cache)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo_audit_mode.sh"), str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    out = proc.stdout + proc.stderr
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in (tmp_path / "demo").glob("*.log"))
    assert proc.returncode == 0, out[-3000:] + logs
    assert "swarmrl_validator_audits_total{result=\"findings\"} 0.0" in out, out[-3000:]
    assert f"statements from the trainer over libp2p (head version {STEPS})" in out, out[-3000:]
    assert f"replayed {STEPS} version(s) from version 0: 0 not the credited step" in out, out[-3000:]
    assert "statements from mirror" in out and "1 holder(s) failed" in out, out[-3000:]
    assert out.count("no findings: the books add up") == 3, out[-3000:]
