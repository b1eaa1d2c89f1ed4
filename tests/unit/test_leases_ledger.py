"""Leases (issue, expire, re-issue) and the SQLite ledger (durable admission, restart)."""

from swarmrl.node.trainer.leases import LeaseBook
from swarmrl.node.trainer.ledger import Ledger
from swarmrl.protocol.pb import swarm_pb2 as pb


def test_indices_are_sequential_and_expired_ones_come_back_first():
    book = LeaseBook("J", ttl_ms=100)
    a = book.issue("w1", 3, 0, pb.SamplingParams(), now_ms=0)
    b = book.issue("w2", 2, 0, pb.SamplingParams(), now_ms=0)
    assert list(a.prompt_indices) == [0, 1, 2] and list(b.prompt_indices) == [3, 4]
    book.record_answers(a.lease_id, [0])
    assert book.expire(now_ms=50) == []
    assert set(book.expire(now_ms=101)) == {a.lease_id, b.lease_id}
    c = book.issue("w3", 4, 1, pb.SamplingParams(), now_ms=200)
    assert sorted(c.prompt_indices) == [1, 2, 3, 4]
    assert list(book.issue("w3", 1, 1, pb.SamplingParams(), now_ms=200).prompt_indices) == [5]


def test_fully_answered_lease_closes():
    book = LeaseBook("J", ttl_ms=100)
    a = book.issue("w", 2, 0, pb.SamplingParams(), now_ms=0)
    assert not book.record_answers(a.lease_id, [0])
    assert book.record_answers(a.lease_id, [1])
    assert book.get(a.lease_id) is None


def test_ledger_survives_reopen_and_tracks_group_states(tmp_path):
    path = tmp_path / "ledger.sqlite"
    led = Ledger(path)
    lease = pb.Lease(lease_id="L", job_id="J", peer_id="P", prompt_indices=[0, 1], deadline_ms=99)
    led.add_lease(lease)
    batch = pb.RolloutBatch(job_id="J", lease_id="L", peer_id="P")
    groups = [pb.Group(prompt_index=i, completions=[pb.Completion(policy_version=2)]) for i in (0, 1)]
    led.admit("b1", batch, pb.Signed(body=b"x"), groups, now_ms=5)
    led.reject("J", "Q", "replay", now_ms=6, count=2)
    led.close()

    led = Ledger(path)
    assert led.batch_seen("b1") and not led.batch_seen("b2")
    assert led.admitted_indices("J") == {0, 1}
    pending = led.pending("J", 10)
    assert [p.group.prompt_index for p in pending] == [0, 1]
    led.mark([pending[0].row_id], "trained", step=1)
    assert led.count_pending("J") == 1
    assert led.drop_peer("J", "P", "banned") == 1
    assert led.group_counts("J") == {"trained": 1, "dropped": 1}
    assert led.rejection_counts("J") == {"replay": 2}
    restored = LeaseBook("J", ttl_ms=10)
    restored.restore(led.leases("J", open_only=True), led.admitted_indices("J"))
    assert list(restored.issue("w", 1, 0, pb.SamplingParams(), now_ms=0).prompt_indices) == [2]


def test_an_index_answered_under_a_revoked_lease_is_not_reissued():
    book = LeaseBook("J", ttl_ms=100)
    a = book.issue("w1", 2, 0, pb.SamplingParams(), now_ms=0)
    book.revoke([a.lease_id])
    book.record_answers(a.lease_id, [0])  # the answer was already in flight
    b = book.issue("w2", 2, 0, pb.SamplingParams(), now_ms=1)
    assert list(b.prompt_indices) == [1, 2]


def test_open_of_and_expire_follow_the_indexes_through_answers_revokes_and_restore():
    """open_of reads a per-peer index and expire a deadline heap: both agree with the open leases
    after answers, revokes, expiries and a restore."""
    book = LeaseBook("J", ttl_ms=100)
    a = book.issue("w1", 2, 0, pb.SamplingParams(), now_ms=0)
    b = book.issue("w2", 2, 0, pb.SamplingParams(), now_ms=10)
    c = book.issue("w1", 2, 0, pb.SamplingParams(), now_ms=20)
    d = book.issue("w1", 2, 0, pb.SamplingParams(), now_ms=30)
    assert book.open_of("w1") == [a.lease_id, c.lease_id, d.lease_id] and book.open_of("w3") == []
    assert book.record_answers(a.lease_id, list(a.prompt_indices))        # fully answered: closed
    book.revoke([c.lease_id])
    assert book.open_of("w1") == [d.lease_id]
    assert book.expire(now_ms=105) == []                                  # a's deadline passes closed
    assert book.expire(now_ms=111) == [b.lease_id] and book.open_of("w2") == []
    assert book.expire(now_ms=131) == [d.lease_id] and book.open_of("w1") == []
    e = book.issue("w4", 1, 0, pb.SamplingParams(), now_ms=200)
    restored = LeaseBook("J", ttl_ms=100)
    restored.restore([e], admitted=set())
    assert restored.open_of("w4") == [e.lease_id] and restored.expire(now_ms=301) == [e.lease_id]


def test_one_transaction_records_a_batch_its_rejections_and_the_lease_closing(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    lease = pb.Lease(lease_id="L1", job_id="J", peer_id="P", prompt_indices=[3, 4], deadline_ms=10)
    ledger.add_lease(lease)
    batch = pb.RolloutBatch(job_id="J", lease_id="L1", peer_id="P")
    group = pb.Group(prompt_index=3, completions=[pb.Completion(policy_version=0)])
    ledger.admit("b1", batch, pb.Signed(), [group], 5, close_lease=True, rejections={"stale": 2})
    assert ledger.admitted_among("J", [3, 4, 9]) == {3} and ledger.admitted_among("J", []) == set()
    assert ledger.rejection_counts("J") == {"stale": 2}
    assert ledger.leases("J", open_only=True) == []
    ledger.close()


def test_render_prompts_gives_render_prompts_ids(model_cache):
    from swarmrl.node.models.base_model import prepare_base_model
    from swarmrl.node.models.causal_lm import load_causal_lm, render_prompt, render_prompts
    from swarmrl.node.tasks.builtin_jobs import builtin_job
    from swarmrl.protocol.envs import job_environment

    spec = builtin_job("tiny", model_cache)
    _, tok = load_causal_lm(prepare_base_model("tiny", model_cache))
    prompts = [job_environment(spec, None).prompt(spec.seed, i) for i in range(12)]
    tok(["a b", "c"], padding=True)   # a padded call before must not leak into ours
    assert render_prompts(tok, prompts) == [render_prompt(tok, p) for p in prompts]
