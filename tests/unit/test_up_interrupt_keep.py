"""What an interrupted `swarmrl up` keeps (node/local/interrupt.py), read from a real trainer's
state folder: a `JobRuntime` on the tiny model takes three real steps (ledger, signed deltas,
checkpoints), stops, and `keep_what_it_did` rebuilds the head adapter, metrics and summary from
what it left on disk."""

from __future__ import annotations

import csv
import json
import os
import signal

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from swarmrl.node.local.interrupt import RunSoFar, interrupted_line, keep_what_it_did, saving
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.models.causal_lm import load_causal_lm
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import adapter as ad
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_red_team import _group

STEPS_TAKEN, TOTAL = 3, 8


@pytest.fixture()
def stopped_trainer(tmp_path, model_cache):
    """A trainer's state folder after STEPS_TAKEN of TOTAL steps, the trainer gone: (run, head hash, head state)."""
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=TOTAL, batch_groups=1, group_size=2, prompts_per_lease=1)
    state_dir = tmp_path / "run" / "trainer"
    trainer, worker = Identity.from_seed(b"t" * 32), Identity.from_seed(b"w" * 32)
    ledger = Ledger(state_dir / "ledger.sqlite")
    job = JobRuntime("job-interrupted", spec, identity=trainer, model_path=prepare_base_model("tiny", model_cache),
                     state_dir=state_dir, ledger=ledger)
    for _ in range(STEPS_TAKEN):
        reply = job.admission.request_lease(worker.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))
        i = reply.lease.prompt_indices[0]
        group = _group(i, job.prompt_ids(i), version=job.version, n=2)
        for c, r in zip(group.completions, [0.0, 1.0], strict=True):   # a reward spread: a real step
            c.reward = r
        batch = pb.RolloutBatch(job_id=job.job_id, lease_id=reply.lease.lease_id, peer_id=worker.peer_id,
                                groups=[group])
        assert job.admission.admit(signing.sign(worker, signing.ROLLOUT_BATCH, batch), 1 << 24).groups[0].admitted
        assert job.train_step() is not None
    head_hash, head_state = job.head_hash, {k: v.clone() for k, v in job.head_state.items()}
    ledger.close()
    run = RunSoFar(tmp_path / "out", keys={"trainer": trainer, "worker0": worker}, trainer_dir=state_dir,
                   spec=spec, job_id=job.job_id)
    run.out.mkdir()
    return run, head_hash, head_state


def test_keeps_the_head_adapter_metrics_and_an_interrupted_summary(stopped_trainer, model_cache) -> None:
    run, head_hash, head_state = stopped_trainer
    adapters = run.trainer_dir / "jobs" / run.job_id / "adapters"
    stored_before = sorted(p.name for p in adapters.iterdir())
    kept = keep_what_it_did(run, "SIGTERM")
    assert kept is not None and (kept.version, kept.steps, kept.total_steps) == (STEPS_TAKEN, STEPS_TAKEN, TOTAL)
    assert sorted(p.name for p in adapters.iterdir()) == stored_before   # rebuilt in memory, nothing written there
    saved = load_file(str(run.out / "adapter" / "adapter_model.safetensors"))
    assert ad.adapter_hash(saved) == head_hash   # snapshot 0 + deltas 1..3: the trainer's own head, bit for bit
    assert all(torch.equal(saved[k], head_state[k]) for k in head_state)
    base, tok = load_causal_lm(prepare_base_model("tiny", model_cache))
    model = PeftModel.from_pretrained(base, str(run.out / "adapter"))
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([tok("Question: What is 1+2?").input_ids])).logits).all()
    with open(run.out / "metrics.csv") as f:
        assert [int(r["policy_version"]) for r in csv.DictReader(f)] == [1, 2, 3]
    assert (run.out / "reward.png").stat().st_size > 1000
    summary = json.loads((run.out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["interrupted_by"] == "SIGTERM"
    assert (summary["steps"], summary["total_steps"], summary["final_version"]) == (STEPS_TAKEN, TOTAL, STEPS_TAKEN)
    assert summary["groups_admitted"] == STEPS_TAKEN and summary["adapter_hash"] == head_hash.hex()
    card = json.loads((run.out / "adapter" / "swarmrl.json").read_text())
    assert card["policy_version"] == STEPS_TAKEN and card["adapter_hash"] == head_hash.hex()
    run.kept = kept
    assert interrupted_line(signal.SIGTERM, run) == (
        f"interrupted by SIGTERM at step 3 of 8: kept the adapter of version 3, metrics.csv, summary.json in {run.out}")


def test_before_the_job_is_submitted_there_is_nothing_to_keep(tmp_path) -> None:
    run = RunSoFar(tmp_path / "out")
    assert keep_what_it_did(run, "SIGINT") is None
    assert interrupted_line(signal.SIGINT, run) == "interrupted by SIGINT before the job was submitted: nothing to keep"
    run.job_id, run.finished = "j", True
    assert interrupted_line(signal.SIGINT, run).startswith("interrupted by SIGINT after the job ended")


def test_a_second_signal_does_not_cut_the_saving_short() -> None:
    """Inside `saving`, SIGTERM and SIGINT are delivered and ignored; afterwards the handlers are back."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with saving():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            done = True
        assert done and seen == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


PLOT_WHILE_WARMING = """
import sys, time
from pathlib import Path
from swarmrl.node.local.interrupt import warm_plotting
from swarmrl.node.local.summary import _plot_reward
from swarmrl.protocol.pb import swarm_pb2 as pb
warm_plotting()
time.sleep(float(sys.argv[2]))
_plot_reward(Path(sys.argv[1]), pb.JobStatus())
"""


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_reward_plot_while_pyplot_is_still_importing_on_the_warm_thread(tmp_path, delay_s):
    """The interrupt path warms pyplot on a thread while the roles stop; when the roles stopped
    first (a loaded machine), reward.png is drawn while that import is under way. It waits for it
    (seen in a suite: matplotlib.use called the half-imported pyplot's switch_backend,
    AttributeError, exit 1 instead of 130/143)."""
    import subprocess
    import sys

    out = tmp_path / "reward.png"
    p = subprocess.run([sys.executable, "-c", PLOT_WHILE_WARMING, str(out), str(delay_s)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert out.stat().st_size > 0
