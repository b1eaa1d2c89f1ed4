"""DiLoCo with two trainers of one job on loopback: two real `JobRuntime`s (tiny model), each
with its own ledger, its own admitted groups and a real hivemind DHT node, train a job with
`sync = "diloco"`. Between outer steps each publishes its own inner versions; at every outer
version both hold bit-identical adapters and outer state (checked by hash), the outer round had
both members, and the bytes each trainer sent are counted (about one float32 copy of the LoRA
parameters per outer round: the butterfly all-reduce of two members sends half out and half
back). A cotrainer whose record carries other sync settings is refused, naming the field.

The trainers meet through records handed to `coordinate`, so the test runs in one process, each
trainer's loop in a thread. Each trainer's adapter store is served by a real gRPC server
(`FetchAdapter`, as `TrainerCalls.fetch_adapter` serves it), so a round that ended differently at
the two members (one got every averaged part, the other timed out on the last: it happens on a
loaded machine) is repaired as in the product: the next round finds the split, or at the job's
last version the records do, and the trainer with the larger id adopts the other's outer version.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
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
from swarmrl.protocol.pb import swarm_pb2_grpc as pb_grpc
from swarmrl.protocol.updates import chunks

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


class _Adapters(pb_grpc.TrainerServicer):  # type: ignore[misc]
    """A trainer's signed updates over gRPC, as the trainer's service streams them."""

    def __init__(self, job: JobRuntime) -> None:
        self.job = job

    def FetchAdapter(self, request, context):
        for update in self.job.updates(request):
            yield from chunks(update.header, update.payload)


def _server(job: JobRuntime) -> tuple[grpc.Server, str]:
    """A gRPC server for `job`'s updates on loopback, not started yet (started after hivemind's
    averager processes are forked: a process serving gRPC should not fork)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_TrainerServicer_to_server(_Adapters(job), server)
    port = server.add_insecure_port("127.0.0.1:0")
    return server, f"127.0.0.1:{port}"


ENDPOINTS: dict[str, str] = {}   # trainer id -> its adapter server


def _record(job: JobRuntime) -> VerifiedRecord:
    endpoint = ENDPOINTS.get(job.identity.peer_id, "127.0.0.1:1")
    return VerifiedRecord(job.record(endpoint), job.identity.peer_id, job.identity.public_key)


@pytest.fixture(params=["int8", "float32"])
def pair(request, tmp_path, model_cache):
    first = start_dht()
    dhts = [first, start_dht(visible_maddrs(first))]
    model = prepare_base_model("tiny", model_cache)
    spec = builtin_job("tiny", model_cache, steps=9, batch_groups=2, prompts_per_lease=1, sync="diloco",
                       inner_steps=3, outer_timeout_s=30.0, delta_codec="int8", outer_codec=request.param)
    jobs, ledgers, servers = [], [], []
    for i, dht in enumerate(dhts):
        ident = Identity.from_seed(bytes([65 + i]) * 32)
        ledger = Ledger(tmp_path / f"t{i}" / "ledger.sqlite")
        job = JobRuntime(JOB, spec, identity=ident, model_path=model, state_dir=tmp_path / f"t{i}", ledger=ledger)
        job.attach_swarm(JobSwarm(dht, ident, JOB, sync=spec.sync_settings(), inner_steps=spec.inner_steps,
                                  matchmaking_s=1.0, timeout_s=10.0))
        jobs.append(job)
        ledgers.append(ledger)
        server, ENDPOINTS[ident.peer_id] = _server(job)
        servers.append(server)
    for job in jobs:   # hivemind starts its averager processes from the main thread only
        job.coordinate([_record(j) for j in jobs])
        assert job.cotraining is not None
        job.cotraining.swarm.outer_rounds(job.learner.params, job.spec.outer_timeout_s, job.spec.outer_codec)
    for server in servers:   # after the averagers' processes are forked
        server.start()
    yield jobs
    for server in servers:
        server.stop(0)
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
    deadline = time.monotonic() + 200
    try:
        while time.monotonic() < deadline:
            if job.done:
                return
            job.coordinate([_record(j) for j in jobs])   # a split this trainer lost is repaired here
            for _ in range(20):   # not ready while it waits for a split's winner: coordinate again
                if job.ready():
                    break
                _feed(job, worker, salt * 1000 + job.version)
            else:
                time.sleep(0.1)
                continue
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
    threads = [threading.Thread(target=_train, args=(job, jobs, seen[i], rows[i], errors, i))
               for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    outer_rows = [[r for r in rs if r.get("outer_step")] for rs in rows]
    for i, rs in enumerate(outer_rows):
        print(i, [(r["step"], r.get("outer_agreed"), r.get("outer_group_size"), round(r.get("outer_seconds", 0), 2))
                  for r in rs])
    by_v = [{int(r["step"]): r for r in rs} for rs in outer_rows]   # a trainer that adopted skips some
    assert all(set(b) <= {3, 6, 9} for b in by_v)
    both = [v for v in (3, 6, 9) if all(b.get(v, {}).get("outer_agreed") == 1.0 for b in by_v)]
    for v in both:   # a round that agreed at both members: bit-identical adapters and outer state
        assert seen[0][v] == seen[1][v], f"outer version {v}: the trainers differ"
    # a round that ended differently is repaired: at the end both hold the same adapter
    syncs = [j.cotraining.swarm.counters["state_syncs"] for j in jobs if j.cotraining is not None]
    deadline = time.monotonic() + 60
    while jobs[0].head_hash != jobs[1].head_hash and time.monotonic() < deadline:
        for job in jobs:
            job.coordinate([_record(j) for j in jobs])
        time.sleep(0.5)
    assert jobs[0].version == jobs[1].version == 9 and jobs[0].head_hash == jobs[1].head_hash
    # inner versions are each trainer's own: different data, different adapters
    inner = [jobs[i].store.state_at(2) for i in (0, 1)]
    assert inner[0] is not None and inner[1] is not None
    assert not all(torch.equal(inner[0][k], inner[1][k]) for k in inner[0])
    assert all(b[v]["outer_group_size"] == 2.0 for b in by_v for v in both)
    n_bytes = 4 * sum(p.numel() for p in jobs[0].learner.params)
    print(f"rounds agreed at both members: {both}; bytes sent per trainer per round: "
          f"{[[r['outer_bytes_sent'] for r in rs] for rs in outer_rows]} (LoRA float32 size {n_bytes})")
    if jobs[0].spec.outer_codec == "int8":   # a byte a value plus a 256-entry float32 codebook per tensor part
        n_bytes = sum(p.numel() + 8 + 4 * 256 if p.numel() >= MIN_QUANTISED else 4 * p.numel()
                      for p in jobs[0].learner.params)
    assert both, "no outer round agreed at both members"
    for b in by_v:
        for v in both:
            assert 0.9 * n_bytes <= b[v]["outer_bytes_sent"] <= 1.2 * n_bytes
    for job, rs, before in zip(jobs, outer_rows, syncs):   # int8: each trainer carries what its own sent
        assert job.outer is not None and job.cotraining is not None   # parts lost (error feedback) after a
        carried = job.outer.error_P                                   # round it agreed in, else nothing
        adopted = job.cotraining.swarm.counters["state_syncs"] > before   # an adopted outer state carries none
        if job.spec.outer_codec == "int8" and rs[-1]["step"] == 9 and rs[-1]["outer_agreed"] == 1.0 and not adopted:
            assert carried is not None and any(float(e.abs().sum()) > 0 for e in carried)
            assert [e.shape for e in carried] == [p.shape for p in job.learner.params]
        else:
            assert carried is None or all(float(e.abs().sum()) == 0 for e in carried)
    assert jobs[0].cotraining is not None
    assert jobs[0].cotraining.swarm.counters["outer_rounds"] == len(outer_rows[0])
    assert jobs[0].cotraining.swarm.counters["outer_solo"] == sum(r["outer_agreed"] == 0.0 for r in outer_rows[0])


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
