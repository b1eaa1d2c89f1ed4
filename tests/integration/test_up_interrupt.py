"""An interrupted `swarmrl up` keeps what it did: a real `up --model tiny` (every role its own
process) gets SIGTERM (or Ctrl-C twice) once its output shows step 2; it stops the roles, keeps
the head adapter (loadable with peft), metrics.csv and a summary.json marked interrupted, says so
in one line and exits 143 (130) within seconds."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from swarmrl.node.local.interrupt import SAVE_BOUND_S
from swarmrl.node.local.processes import STOP_S
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import load_causal_lm
from swarmrl.node.runtime.procs import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOTAL = 60
STEP_LINE = re.compile(rf"^training (\d+)/{TOTAL} ", re.MULTILINE)


def _step_shown(text: str) -> int:
    return max((int(m) for m in STEP_LINE.findall(text)), default=-1)


@contextlib.contextmanager
def _up_at_step_2(out: Path, log: Path, model_cache: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real `up --model tiny` of TOTAL steps (output into `log`), yielded once its output shows
    step 2; killed on the way out if still running."""
    with open(log, "wb") as f:
        up = subprocess.Popen([sys.executable, "-m", "swarmrl.node.cli.main", "up", "--model", "tiny", "--steps",
                               str(TOTAL), "--workers", "2", "--out", str(out), "--cache-dir", str(model_cache),
                               "--no-eval"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while _step_shown(log.read_text(errors="replace")) < 2:
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield up
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()


@pytest.mark.parametrize(("sig", "times"), [(signal.SIGTERM, 1), (signal.SIGINT, 2)], ids=["sigterm", "ctrl-c-twice"])
def test_an_interrupt_keeps_the_adapter_metrics_and_summary(tmp_path, model_cache, sig, times) -> None:
    """SIGTERM once, or Ctrl-C twice (the second while up stops the roles: it must not cut the saving short)."""
    out, log = tmp_path / "up", tmp_path / "up.log"
    with _up_at_step_2(out, log, model_cache) as up:
        t0 = time.monotonic()
        for i in range(times):
            time.sleep(0.5 * i)
            up.send_signal(sig)
        code = up.wait(STOP_S + SAVE_BOUND_S)
        seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    name = signal.Signals(sig).name
    print(f"up exited {code} {seconds:.1f}s after {name} x{times}; last line: {text.splitlines()[-1]}")
    assert code == 128 + sig, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_by"] == name
    assert summary["total_steps"] == TOTAL and 2 <= summary["steps"] < TOTAL
    steps, version = summary["steps"], summary["final_version"]
    assert text.splitlines()[-1] == (f"swarmrl up: interrupted by {name} at step {steps} of {TOTAL}: kept the adapter "
                                     f"of version {version}, metrics.csv, summary.json in {out}")
    assert version >= steps
    with open(out / "metrics.csv") as f:
        assert [int(r["policy_version"]) for r in csv.DictReader(f)] == list(range(1, steps + 1))
    assert json.loads((out / "adapter" / "swarmrl.json").read_text())["policy_version"] == version
    base, tok = load_causal_lm(prepare_base_model("tiny", model_cache))
    model = PeftModel.from_pretrained(base, str(out / "adapter"))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([tok("Question: What is 1+2?").input_ids])).logits).all()


def _role_pid(up_pid: int, role: str) -> int | None:
    """The pid of `up`'s child running `swarmrl <role>` (its command line names the role)."""
    for pid in descendants(up_pid):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "swarmrl.node.cli.main" in cmd and cmd[cmd.index("swarmrl.node.cli.main") + 1:][:1] == [role]:
                return pid
    return None


def test_a_failed_run_keeps_the_adapter_metrics_and_summary(tmp_path, model_cache) -> None:
    """A role that dies mid-run (the validator, SIGKILL) fails the run in one line, exit 1, and the
    run keeps what it did as an interrupt does (summary.json: interrupted_by "failure")."""
    out, log = tmp_path / "up", tmp_path / "up.log"
    with _up_at_step_2(out, log, model_cache) as up:
        validator = _role_pid(up.pid, "validator")
        assert validator is not None
        os.kill(validator, signal.SIGKILL)
        code = up.wait(STOP_S + SAVE_BOUND_S + 30)
    text = log.read_text(errors="replace")
    assert code == 1 and "Traceback" not in text, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_by"] == "failure"
    steps, version = summary["steps"], summary["final_version"]
    assert 2 <= steps < TOTAL and version >= steps
    assert text.splitlines()[-1] == (f"swarmrl up: validator exited with code -9; the run reached step {steps} of "
                                     f"{TOTAL}: kept the adapter of version {version}, metrics.csv, summary.json in "
                                     f"{out} (logs: {out}/run/logs/)")
    assert json.loads((out / "adapter" / "swarmrl.json").read_text())["policy_version"] == version
