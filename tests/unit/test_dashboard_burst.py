"""A burst of 200 requests at a trainer's job page, panel, status JSON and /metrics while it
steps: every request is answered and the step completes (its time with and without a burst is
benchmarks/dashboard_burst.py's figure, not asserted here)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import torch

from benchmarks.dashboard_burst import JOB, admit_batch, burst
from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.ops import start_trainer_ops
from swarmrl.protocol.identity import Identity


def test_step_completes_under_a_burst_of_page_requests(tmp_path: Path, model_cache) -> None:
    torch.manual_seed(0)
    spec = builtin_job("tiny", model_cache, steps=3, batch_groups=2, prompts_per_lease=1)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime(JOB, spec, identity=Identity.from_seed(b"t" * 32), model_path=prepare_base_model("tiny", model_cache),
                     state_dir=tmp_path, ledger=ledger)
    trainer = SimpleNamespace(jobs={JOB: job}, identity=job.identity, unrouted_rejections=0, grpc_guard=None)
    ops = start_trainer_ops(trainer, SimpleNamespace(metrics_port=0, metrics_host="127.0.0.1"))
    assert ops is not None
    try:
        admit_batch(job, Identity.from_seed(b"w" * 32), 0)
        urls = [ops.url(f"/jobs/{JOB}"), ops.url(f"/jobs/{JOB}/panel"), ops.url(f"/jobs/{JOB}/status.json"),
                ops.url("/metrics")]
        codes: list[int] = []
        t = threading.Thread(target=lambda: codes.extend(burst(urls, 200)))
        t.start()
        row = job.train_step()
        t.join(120)
        assert row is not None and job.version == 1
        assert codes == [200] * 200
        assert "swarmrl_trainer_steps_total" in burst_body(ops.url("/metrics"))
    finally:
        ops.close()
        ledger.close()


def burst_body(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()
