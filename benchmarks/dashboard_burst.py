"""Does a burst of page requests slow the trainer's step? The step's time with and without 200
concurrent requests at the job page, its panel, its status JSON and /metrics.

As in a trainer, a tiny-model `JobRuntime` and the trainer's ops server (`node.trainer.ops`,
status cache and all) share one interpreter, so the server's request handling competes with the
step for the GIL and the ledger lock; the burst's clients are another process (as browsers are),
started before the round and told to fire just before the step. Rounds alternate quiet and burst
steps on the same kind of batch (admitted from a fake worker, rewards with spread). Prints, as
JSON: median seconds of each, their ratio and difference, and the burst's answers.
Usage (one torch thread, as a trainer of a local swarm has):

    .venv/bin/python benchmarks/dashboard_burst.py --rounds 6 --requests 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

from swarmrl.node.models.base_model import default_cache_dir, prepare_base_model
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.node.trainer.ops import start_trainer_ops
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

JOB = "0f" * 16


def admit_batch(job: JobRuntime, worker: Identity, round_: int) -> None:
    """Lease and admit `batch_groups` groups whose rewards vary (so the step has signal)."""
    while job.ledger.count_pending(JOB) < job.spec.batch_min:
        reply = job.admission.request_lease(worker.peer_id, pb.LeaseRequest(job_id=JOB, max_prompts=1,
                                                                             adapter_version=job.version))
        assert reply.HasField("lease"), reply.reason
        lease = reply.lease
        groups = []
        for i in lease.prompt_indices:
            comps = [pb.Completion(token_ids=[5 + k, 6, 7], logprobs=[-1.0, -0.5, -0.7], finish_reason="stop",
                                   policy_version=lease.policy_version, rewards=[float(k % 2), 0.0],
                                   reward=float(k % 2)) for k in range(job.spec.group_size)]
            groups.append(pb.Group(prompt_index=i, prompt_token_ids=job.prompt_ids(i), completions=comps))
        batch = pb.RolloutBatch(job_id=JOB, lease_id=lease.lease_id, peer_id=worker.peer_id, groups=groups,
                                nonce=round_.to_bytes(4, "little") + bytes(lease.lease_id, "ascii")[:12])
        receipt = job.admission.admit(signing.sign(worker, signing.ROLLOUT_BATCH, batch), 1 << 24)
        assert receipt.accepted, receipt.reason


def burst(urls: list[str], n: int) -> list[int]:
    def get(url: str) -> int:
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                r.read()
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
    with ThreadPoolExecutor(50) as pool:
        return list(pool.map(get, [urls[i % len(urls)] for i in range(n)]))


def client(n: int) -> subprocess.Popen:
    """A process that fires `n` requests (50 at a time) at the URLs read from its stdin."""
    return subprocess.Popen([sys.executable, __file__, "--client", str(n)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def timed_step(job: JobRuntime) -> float:
    t0 = time.monotonic()
    job.train_step()
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print("ready", flush=True)
        print(json.dumps(burst(json.loads(sys.stdin.readline()), args.client)), flush=True)
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cache = default_cache_dir()
    spec = builtin_job("tiny", cache, steps=2 * args.rounds + 1, batch_groups=2, prompts_per_lease=1)
    with tempfile.TemporaryDirectory() as tmp:
        ledger = Ledger(Path(tmp) / "ledger.sqlite")
        job = JobRuntime(JOB, spec, identity=Identity.from_seed(b"t" * 32), model_path=prepare_base_model("tiny", cache),
                         state_dir=Path(tmp), ledger=ledger)
        trainer = SimpleNamespace(jobs={JOB: job}, identity=job.identity, unrouted_rejections=0, grpc_guard=None)
        ops = start_trainer_ops(trainer, SimpleNamespace(metrics_port=0, metrics_host="127.0.0.1"))
        assert ops is not None
        urls = [ops.url(f"/jobs/{JOB}"), ops.url(f"/jobs/{JOB}/panel"), ops.url(f"/jobs/{JOB}/status.json"),
                ops.url("/metrics")]
        worker = Identity.from_seed(b"w" * 32)
        quiet, loud, answers = [], [], []
        try:
            admit_batch(job, worker, 0)
            timed_step(job)   # warm-up
            for r in range(args.rounds):
                admit_batch(job, worker, 2 * r + 1)
                quiet.append(timed_step(job))
                admit_batch(job, worker, 2 * r + 2)
                proc = client(args.requests)
                assert proc.stdin is not None and proc.stdout is not None
                assert proc.stdout.readline().strip() == "ready"
                proc.stdin.write(json.dumps(urls) + "\n")
                proc.stdin.flush()
                loud.append(timed_step(job))
                answers += json.loads(proc.stdout.readline())
                proc.wait()
        finally:
            ops.close()
            ledger.close()
    q, b = statistics.median(quiet), statistics.median(loud)
    print(json.dumps({"rounds": args.rounds, "requests_per_burst": args.requests,
                      "step_seconds_quiet_median": round(q, 3), "step_seconds_burst_median": round(b, 3),
                      "ratio_burst_over_quiet": round(b / q, 2), "extra_seconds_per_step": round(b - q, 3), "quiet": [round(x, 3) for x in quiet],
                      "burst": [round(x, 3) for x in loud],
                      "answers": {str(c): answers.count(c) for c in sorted(set(answers))}}, indent=2))


if __name__ == "__main__":
    main()
