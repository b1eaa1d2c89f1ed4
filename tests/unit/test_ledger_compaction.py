"""The ledger stays small over a long job (`Ledger.compact`, called at each step by
`JobRuntime.compact_ledger`) and keeps what it exists for: replays refused, no admitted prompt
admitted again, no pending rollout touched, validators offered the batches still whole."""

from __future__ import annotations

import pytest
import torch

from swarmrl.node.models.base_model import prepare_base_model
from swarmrl.node.runtime.config import TrainerConfig
from swarmrl.node.tasks.builtin_jobs import builtin_job
from swarmrl.node.trainer.job import LEDGER_KEEP_MS, JobRuntime
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol import admission as adm
from swarmrl.protocol import signing
from swarmrl.protocol.identity import Identity
from swarmrl.protocol.pb import swarm_pb2 as pb
from tests.unit.test_red_team import _group
from tests.unit.test_trainer_job import FakeClock, _honest_batch, _lease, _submit

KEEP_MS = 60_000
N = 3000
TTL_MS = 30_000


def _admit(led: Ledger, n: int, now: int) -> tuple[str, pb.Group]:
    """Lease n (prompt index n, deadline now + TTL_MS) answered by one admitted batch at `now`."""
    lease = pb.Lease(lease_id=f"L{n}", job_id="J", peer_id=f"P{n % 7}", prompt_indices=[n], deadline_ms=now + TTL_MS)
    led.add_lease(lease)
    group = pb.Group(prompt_index=n, prompt_token_ids=[1, 2, 3],
                     completions=[pb.Completion(token_ids=list(range(200)), logprobs=[-0.5] * 200, policy_version=0)])
    batch = pb.RolloutBatch(job_id="J", lease_id=lease.lease_id, peer_id=lease.peer_id, groups=[group])
    led.admit(f"b{n}", batch, pb.Signed(body=batch.SerializeToString()), [group], now, close_lease=True)
    return lease.lease_id, group


def test_a_long_job_keeps_the_window_whole_and_every_row_replay_needs(tmp_path):
    """3000 batches, one a second; every 300th stays pending (a peer on probation); the others are
    trained 5 s after they arrive; the ledger is compacted every 10 s."""
    led = Ledger(tmp_path / "ledger.sqlite", synchronous="normal")   # fsync-free: 3000 commits
    pending_kept: dict[int, pb.Group] = {}
    sizes = []
    for n in range(N):
        now = n * 1000
        _, group = _admit(led, n, now)
        if n % 300 == 150:
            pending_kept[n] = group
        led.mark([p.row_id for p in led.pending("J", 20)
                  if p.group.prompt_index <= n - 5 and p.group.prompt_index not in pending_kept], "trained", step=n)
        if n % 10 == 0:
            led.compact("J", now - KEEP_MS)
            sizes.append(led.stored_bytes("J"))
    window = KEEP_MS // 1000 + 10   # batches of the last KEEP_MS, and up to one compaction period
    late = sizes[len(sizes) // 2:]
    # whole batches and live leases: the window (plus the pending ones), whatever the job's length
    assert max(s["leases"] for s in late) <= window + TTL_MS // 1000 + len(pending_kept)
    assert max(s["group_bytes"] for s in late) <= (window + len(pending_kept)) * max(
        len(g.SerializeToString()) for g in pending_kept.values())
    assert max(s["batch_bytes"] for s in late) < 2 * sizes[len(sizes) // 4]["batch_bytes"]
    # the database itself: a cleared batch costs its small rows, not the pages its payload took
    # (an in-place UPDATE left each cleared group a near-empty 4 KiB page: ~8 KiB a batch here)
    grown = (sizes[-1]["db_bytes"] - sizes[len(sizes) // 2]["db_bytes"]) / (N // 2)
    assert grown < 1024, f"{grown:.0f} bytes per batch past the window"
    # every batch id and every admitted index stays: a replayed batch is refused, no index twice
    assert all(led.batch_seen(f"b{n}") for n in range(N))
    assert led.admitted_indices("J") == set(range(N))
    assert led.admitted_among("J", [3, N - 1, N]) == {3, N - 1}
    # an old lease is gone (a batch naming it is refused unknown_lease); a pending one's stays
    assert led.lease("L3") is None and led.lease("L150") is not None
    # no pending rollout lost: the pending groups come back whole
    pending = {p.group.prompt_index: p.group for p in led.pending("J", 100)}
    assert set(pending) == set(pending_kept) | set(range(N - 5, N))
    assert {i: pending[i] for i in pending_kept} == pending_kept
    # validators are offered the whole batches only, with their leases
    offered = led.batches_after("J", 0, 10_000)
    assert {lid for _, lid, _ in offered} >= {f"L{n}" for n in pending_kept}
    assert all(env.body and led.lease(lid) is not None for _, lid, env in offered)
    assert len(offered) <= window + len(pending_kept)
    assert led.group_counts("J") == {"trained": N - 5 - len(pending_kept), "pending": 5 + len(pending_kept)}
    led.close()


def test_a_backlog_drains_over_calls(tmp_path):
    led = Ledger(tmp_path / "ledger.sqlite", synchronous="normal")
    for n in range(25):
        _admit(led, n, n * 1000)
    led.mark([p.row_id for p in led.pending("J", 100)], "trained", step=1)
    done = [led.compact("J", 10**9, limit=10) for _ in range(4)]
    assert done == [(10, 10), (10, 10), (5, 5), (0, 0)]
    assert led.stored_bytes("J")["group_bytes"] == 0 and led.batch_seen("b0") and led.batch_seen("b24")
    led.close()


def test_the_config_default_is_the_runtime_default():
    assert TrainerConfig().ledger_keep_s * 1000 == LEDGER_KEEP_MS


@pytest.fixture()
def runtime(tmp_path, model_cache):
    torch.manual_seed(0)
    clock = FakeClock()
    spec = builtin_job("tiny", model_cache, steps=8, batch_groups=1, prompts_per_lease=2)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    job = JobRuntime("job-compact", spec, identity=Identity.from_seed(b"t" * 32), ledger=ledger,
                     model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path, clock=clock,
                     ledger_keep_ms=KEEP_MS)
    yield job, ledger, clock, tmp_path, model_cache
    ledger.close()


def _batch(job: JobRuntime, who: Identity, lease: pb.Lease) -> pb.Signed:
    """An honest batch answering `lease` whose groups carry a signal (rewards 0 and 1)."""
    body = pb.RolloutBatch.FromString(_honest_batch(job, who, lease).body)
    for g in body.groups:
        for i, c in enumerate(g.completions):
            c.reward = float(i % 2)
    return signing.sign(who, signing.ROLLOUT_BATCH, body)


def test_after_compaction_replays_are_refused_and_pending_rollouts_survive(runtime) -> None:
    job, ledger, clock, tmp_path, model_cache = runtime
    worker, other = Identity.from_seed(b"w" * 32), Identity.from_seed(b"o" * 32)
    trained_lease = _lease(job, worker)
    trained = _batch(job, worker, trained_lease)
    assert _submit(job, trained).accepted and job.ready() and job.train_step() is not None
    held_lease = _lease(job, other)   # its group stays pending (admitted after the step)
    held = _batch(job, other, held_lease)
    assert _submit(job, held).accepted
    clock.advance((KEEP_MS + job.spec.lease_ttl_s * 1000) / 1000 + 1)
    assert job.compact_ledger() == (1, 1)
    assert ledger.lease(trained_lease.lease_id) is None
    assert ledger.stored_bytes(job.job_id)["group_bytes"] == sum(
        len(g.SerializeToString()) for g in pb.RolloutBatch.FromString(held.body).groups)
    # the same batch again: refused as a replay; a fresh batch on the compacted lease: refused as
    # an unknown lease; neither blames the worker (anyone can copy a batch)
    again = _submit(job, trained)
    assert not again.accepted and again.reason == adm.REPLAY
    body = pb.RolloutBatch.FromString(trained.body)
    body.groups[0].completions[0].reward = 0.2
    fresh = _submit(job, signing.sign(worker, signing.ROLLOUT_BATCH, body))
    assert not fresh.accepted and fresh.reason == adm.UNKNOWN_LEASE
    assert not job.admission.strikes and not job.admission.banned
    # the pending group is intact and trainable, its batch still offered to validators
    pending = ledger.pending(job.job_id, 10)
    assert [p.group for p in pending] == list(pb.RolloutBatch.FromString(held.body).groups)
    assert [lid for _, lid, _ in ledger.batches_after(job.job_id, 0, 10)] == [held_lease.lease_id]
    # a restart on the compacted ledger hands out none of the admitted prompts again
    admitted = set(trained_lease.prompt_indices) | set(held_lease.prompt_indices)
    again_job = JobRuntime(job.job_id, job.spec, identity=job.identity, ledger=ledger, clock=clock,
                           model_path=prepare_base_model("tiny", model_cache), state_dir=tmp_path)
    fresh_lease = _lease(again_job, worker)
    assert not admitted.intersection(fresh_lease.prompt_indices)
    g = _group(trained_lease.prompt_indices[0], again_job.prompt_ids(trained_lease.prompt_indices[0]),
               n=job.spec.group_size)
    late = pb.RolloutBatch(job_id=job.job_id, lease_id=fresh_lease.lease_id, peer_id=worker.peer_id, groups=[g])
    verdicts = _submit(again_job, signing.sign(worker, signing.ROLLOUT_BATCH, late)).groups
    assert [v.admitted for v in verdicts] == [False]   # an admitted prompt is never admitted twice
