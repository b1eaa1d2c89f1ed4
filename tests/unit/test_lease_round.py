"""A round over two jobs' leases (`node.worker.lease_round.run_round`, issue 24 item 2): each job's
rollouts go to its own trainer, and a trainer that fails after leasing costs its own job's lease
only; the other job's rollouts are still graded, signed, submitted and admitted.

Trainer A is in this process (`InProcessTrainer`); trainer B serves over real gRPC on 127.0.0.1
and is stopped after it granted its lease, so B's submit fails as an unreachable trainer's does
(UNAVAILABLE, after the client's retries). The backend is transformers (tiny model), whose
`generate_batch` runs the requests in turn: the round's logic is the same on vLLM, where one
engine batch carries them (tests/integration/test_vllm_multi_job.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from swarmrl.node.local.inprocess import InProcessTrainer
from swarmrl.node.net import grpc_wire
from swarmrl.node.runtime.config import TrainerConfig, WorkerConfig
from swarmrl.node.submitter.client import sign_job
from swarmrl.node.swarm.dht import VerifiedRecord
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.service import serve
from swarmrl.node.worker.lease_round import Held, run_round, token_shares
from swarmrl.node.worker.main import Worker
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_worker_market import Stop


def test_token_shares() -> None:
    assert token_shares([30, 10]) == [0.75, 0.25]
    assert token_shares([0, 0]) == [0.5, 0.5]


@pytest.mark.parametrize("fails_before", ["catch_up", "submit"])
def test_a_failed_trainer_loses_only_its_own_jobs_rollouts(tmp_path: Path, model_cache: Path, fails_before: str) -> None:
    """B's trainer goes away after granting its lease: before B's catch-up (its adapter comes from
    that trainer), or after it, so that B's rollouts are generated and graded and only the
    submit fails."""
    spec = builtin_job("tiny", model_cache, steps=3, batch_groups=4, prompts_per_lease=2)
    submitter = Identity.generate()
    trainers = [InProcessTrainer(TrainerConfig(state_dir=tmp_path / f"trainer{i}", cache_dir=model_cache),
                                 Identity.generate()) for i in range(2)]
    a = trainers[0].submit_job(sign_job(submitter, spec)).job_id
    b = trainers[1].submit_job(sign_job(submitter, spec.model_copy(update={"seed": 1}))).job_id
    server, port = serve(trainers[1].trainer, "127.0.0.1", 0, max_message_mb=64)
    rec_a = trainers[0].verified_record(a)
    rec_b = VerifiedRecord(trainers[1].trainer.jobs[b].record(f"127.0.0.1:{port}"), trainers[1].identity.peer_id,
                           trainers[1].identity.public_key)

    def connect(record: pb.JobRecord):   # A in process, B over gRPC (plaintext: its record pins no certificate)
        if record.endpoint == trainers[0].endpoint:
            return trainers[0].connect(record)
        return grpc_wire.connect(record, max_message_mb=64)

    worker = Worker(WorkerConfig(base_model="tiny", cache_dir=model_cache, key=tmp_path / "w.key", max_prompts=2,
                                 gossip=False), Identity.generate(), connect=connect)
    try:
        held = [worker._lease(rec_b), worker._lease(rec_a)]   # B first: its failure comes before A's submit
        assert all(isinstance(h, Held) for h in held)
        if fails_before == "submit":
            worker.sessions[b].catch_up(held[0].lease.policy_version)   # B's adapter in hand
        else:   # the worker caught up to B's head before asking (catch_up_to_head); as if B had published
            replica = worker.sessions[b].replica   # between that and the lease, the lease's version is not held
            replica.state, replica.version, replica.hash = None, -1, b""
        server.stop(None).wait(5)   # B's trainer goes away with its lease granted
        stop = Stop()
        done = run_round(worker.backend, [h for h in held if isinstance(h, Held)],
                         functools.partial(worker._guard, stop=stop, wait=False))
        assert [(h.job_id, r.admitted, r.groups, r.reasons) for h, r in done] == [(a, 2, 2, [])]
        assert trainers[0].trainer.jobs[a].ledger.count_pending(a) == 2
        assert trainers[1].trainer.jobs[b].ledger.count_pending(b) == 0
        graded = 2 * spec.group_size if fails_before == "submit" else 0   # generated and graded, never received
        assert worker.sessions[b].stats.rollouts_graded == graded
        assert worker.sessions[a].stats.groups_admitted == 2 and worker.sessions[b].stats.groups_admitted == 0
        assert stop.waits == []   # no wait inside a round of several jobs
        assert worker._failed_trainers.keys() == {rec_b.trainer_id}   # B is skipped a while, as a one-job round does
    finally:
        worker.close()
        for t in trainers:
            t.close()


@pytest.mark.parametrize("k", [1, 3])
def test_the_transformers_backend_runs_one_job_a_round(tmp_path: Path, model_cache: Path, k: int) -> None:
    """`jobs_per_round` is a vLLM setting: on transformers a round leases one job whatever it says."""
    spec = builtin_job("tiny", model_cache, steps=3, batch_groups=4, prompts_per_lease=2)
    trainer = InProcessTrainer(TrainerConfig(state_dir=tmp_path / "trainer", cache_dir=model_cache), Identity.generate())
    jobs = [trainer.submit_job(sign_job(Identity.generate(), spec.model_copy(update={"seed": s}))).job_id
            for s in range(2)]
    worker = Worker(WorkerConfig(base_model="tiny", cache_dir=model_cache, key=tmp_path / "w.key", max_prompts=2,
                                 gossip=False, jobs_per_round=k), Identity.generate(), connect=trainer.connect)
    try:
        assert not worker.backend.batches_adapters
        assert worker.work([trainer.verified_record(j) for j in jobs], Stop())
        assert worker.report()["rounds_by_jobs"] == {"1": 1}
        assert sum(trainer.trainer.jobs[j].ledger.count_pending(j) for j in jobs) == 2
    finally:
        worker.close()
        trainer.close()
