"""DiLoCo with two trainers of one job on loopback: two real `JobRuntime`s (tiny model), each
with its own ledger, its own admitted groups and a real hivemind DHT node, train a job with
`sync = "diloco"`. Between outer steps each publishes its own inner versions; at every outer
version both hold bit-identical adapters and outer state (checked by hash), the outer round had
both members, and the bytes each trainer sent are counted (about one float32 copy of the LoRA
parameters per outer round: the butterfly all-reduce of two members sends half out and half
back). A cotrainer whose record carries other sync settings is refused, naming the field.

The trainers meet through records handed to `coordinate` (no gRPC server), so the test runs in
one process, each trainer's loop in a thread.
"""

from __future__ import annotations

import threading

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.swarm.dht import VerifiedRecord, start_dht, visible_maddrs
from swarmrl.node.swarm.job_swarm import JobSwarm
from swarmrl.node.swarm.outer_round import MIN_QUANTISED
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import diloco, signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb

pytestmark = pytest.mark.integration
JOB = "diloco-job"


def _group(index: int, prompt: list[int], version: int, n: int, salt: int) -> pb.Group:
    comps = [pb.Completion(token_ids=[5 + (k + salt) % 7, 6 + k % 3], logprobs=[-1.0, -0.5], finish_reason="stop",
                           policy_version=version, rewards=[0.0, float(k % 2)], reward=float(k % 2))
             for k in range(n)]
    return pb.Group(prompt_index=index, prompt_token_ids=prompt, completions=comps)


def _feed(job: JobRuntime, worker: Identity, salt: int) -> None:
    """Lease one prompt from `job` and submit an honest group with mixed rewards for it."""
    reply = job.admission.request_lease(worker.peer_id, pb.LeaseRequest(job_id=job.job_id, max_prompts=1))
    if not reply.HasField("lease"):
        return
    lease = reply.lease
    groups = [_group(i, job.prompt_ids(i), lease.policy_version, job.spec.group_size, salt + i)
              for i in lease.prompt_indices]
    batch = pb.RolloutBatch(job_id=job.job_id, lease_id=lease.lease_id, peer_id=worker.peer_id, groups=groups)
    receipt = job.admission.admit(signing.sign(worker, signing.ROLLOUT_BATCH, batch), 1 << 24)
    assert all(g.admitted for g in receipt.groups), receipt


def _record(job: JobRuntime) -> VerifiedRecord:
    return VerifiedRecord(job.record("127.0.0.1:1"), job.identity.peer_id, job.identity.public_key)


@pytest.fixture(params=["int8", "float32"])
def pair(request, tmp_path, model_cache):
    first = start_dht()
    dhts = [first, start_dht(visible_maddrs(first))]
    model = prepare_base_model("tiny", model_cache)
    spec = builtin_job("tiny", model_cache, steps=9, batch_groups=2, prompts_per_lease=1, sync="diloco",
                       inner_steps=3, outer_timeout_s=30.0, delta_codec="int8", outer_codec=request.param)
    jobs, ledgers = [], []
    for i, dht in enumerate(dhts):
        ident = Identity.from_seed(bytes([65 + i]) * 32)
        ledger = Ledger(tmp_path / f"t{i}" / "ledger.sqlite")
        job = JobRuntime(JOB, spec, identity=ident, model_path=model, state_dir=tmp_path / f"t{i}", ledger=ledger)
        job.attach_swarm(JobSwarm(dht, ident.peer_id, JOB, sync=spec.sync_settings(), inner_steps=spec.inner_steps,
                                  matchmaking_s=1.0, timeout_s=10.0))
        jobs.append(job)
        ledgers.append(ledger)
    yield jobs
    for job in jobs:
        assert job.cotraining is not None
        job.cotraining.swarm.shutdown()
    for ledger in ledgers:
        ledger.close()
    for d in dhts:
        d.shutdown()


def _train(job: JobRuntime, jobs: list[JobRuntime], seen: dict[int, tuple[bytes, bytes]], rows: list[dict],
           errors: list[BaseException], salt: int) -> None:
    worker = Identity.from_seed(bytes([90 + salt]) * 32)
    try:
        for _ in range(400):
            if job.done:
                return
            job.coordinate([_record(j) for j in jobs])
            while not job.ready():
                _feed(job, worker, salt * 1000 + job.version)
            row = job.train_step()
            if row is None:
                continue
            rows.append(row)
            if diloco.is_outer_version(job.version, job.spec.inner_steps):
                params = [p.detach() for p in job.learner.params]
                assert job.outer is not None
                seen[job.version] = (job.head_hash, diloco.tensors_hash(params + job.outer.momentum_P))
        raise AssertionError(f"trainer {salt} did not finish (version {job.version})")
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def test_two_diloco_trainers_agree_by_hash_after_every_outer_step(pair):
    jobs = pair
    seen: list[dict[int, tuple[bytes, bytes]]] = [{}, {}]
    rows: list[list[dict]] = [[], []]
    errors: list[BaseException] = []
    for job in jobs:   # hivemind starts its averager processes from the main thread only
        job.coordinate([_record(j) for j in jobs])
        assert job.cotraining is not None
        job.cotraining.swarm.outer_rounds(job.learner.params, job.spec.outer_timeout_s, job.spec.outer_codec)
    threads = [threading.Thread(target=_train, args=(job, jobs, seen[i], rows[i], errors, i))
               for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    for i, rs in enumerate(rows):
        print(i, [(r["step"], r.get("outer_agreed"), r.get("outer_group_size"), round(r.get("outer_seconds", 0), 2))
                  for r in rs if r.get("outer_step")])
    assert sorted(seen[0]) == sorted(seen[1]) == [3, 6, 9]
    for v in (3, 6, 9):
        assert seen[0][v] == seen[1][v], f"outer version {v}: the trainers differ"
    # inner versions are each trainer's own: different data, different adapters
    inner = [jobs[i].store.state_at(2) for i in (0, 1)]
    assert inner[0] is not None and inner[1] is not None
    assert not all(torch.equal(inner[0][k], inner[1][k]) for k in inner[0])
    outer_rows = [[r for r in rs if r.get("outer_step")] for rs in rows]
    assert all(len(rs) == 3 for rs in outer_rows)
    assert all(r["outer_agreed"] == 1.0 and r["outer_group_size"] == 2.0 for rs in outer_rows for r in rs)
    n_bytes = 4 * sum(p.numel() for p in jobs[0].learner.params)
    sent = [sum(r["outer_bytes_sent"] for r in rs) for rs in outer_rows]
    print(f"bytes sent per trainer over 3 outer rounds: {sent} (LoRA float32 size {n_bytes})")
    if jobs[0].spec.outer_codec == "int8":   # a byte a value plus a 256-entry float32 codebook per tensor part
        n_bytes = sum(p.numel() + 8 + 4 * 256 if p.numel() >= MIN_QUANTISED else 4 * p.numel()
                      for p in jobs[0].learner.params)
    print(f"expected about {3 * n_bytes} over 3 rounds")
    for s in sent:
        assert 0.9 * 3 * n_bytes <= s <= 1.2 * 3 * n_bytes
    for job in jobs:   # int8: each trainer carries what its own sent parts lost (error feedback), else nothing
        assert job.outer is not None
        carried = job.outer.error_P
        if job.spec.outer_codec == "int8":
            assert carried is not None and any(float(e.abs().sum()) > 0 for e in carried)
            assert [e.shape for e in carried] == [p.shape for p in job.learner.params]
        else:
            assert carried is None or all(float(e.abs().sum()) == 0 for e in carried)
    assert jobs[0].cotraining is not None
    assert jobs[0].cotraining.swarm.counters["outer_rounds"] == 3
    assert jobs[0].cotraining.swarm.counters["outer_solo"] == 0


def test_a_cotrainer_with_other_sync_settings_is_refused(model_cache):
    from swarmrl.node.swarm.cotrainers import Cotrainers

    spec = builtin_job("tiny", model_cache, steps=8, sync="diloco", inner_steps=4)
    other = builtin_job("tiny", model_cache, steps=8, sync="diloco", inner_steps=2)
    me, them = Identity.from_seed(b"m" * 32), Identity.from_seed(b"o" * 32)
    rec = pb.JobRecord(job_id=JOB, trainer_id=them.peer_id, endpoint="127.0.0.1:1", spec_json=other.canonical_json(),
                       trainer_public_key=them.public_key)
    cot = Cotrainers(JOB, me.peer_id, sync=spec.sync_settings(), inner_steps=4)
    cot.update([VerifiedRecord(rec, them.peer_id, them.public_key)])
    assert cot.live() == []
    assert cot.refused[them.peer_id] == "different sync settings: inner_steps = 2, ours 4"
    rec.spec_json = spec.canonical_json()
    cot.update([VerifiedRecord(rec, them.peer_id, them.public_key)])
    assert [c.trainer_id for c in cot.live()] == [them.peer_id]
