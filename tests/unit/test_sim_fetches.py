"""The simulator's adapter fetches fail as the product's do (timeouts, departed senders) and the
backlog rule it shares with the trainer counts open leases (protocol/leases.py)."""

from __future__ import annotations

import math
import random

import pytest

from swarmrl.protocol import delta_sources
from swarmrl.protocol.leases import LeaseBook, backlog_full
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.simulations.gossip import PEER_FETCH_TIMEOUT_S, DeltaSpread, SimHolder
from swarmrl.simulations.metrics import Metrics
from swarmrl.simulations.network import MBIT, Uplink, fetch
from swarmrl.simulations.population import Worker
from swarmrl.simulations.run import simulate
from swarmrl.simulations.scenario import Gossip, JobShape, load_scenario
from swarmrl.simulations.trainer import SimTrainer

MB = 1_000_000


def worker(idx: int, *, up_mbit: float = 20.0, leaves_s: float = math.inf, nat: bool = False) -> Worker:
    return Worker(idx=idx, peer_id=f"p{idx}", gpu="rtx4090", tokens_per_s=2000.0, region="na",
                  down_bps=1000 * MBIT, uplink=Uplink("na", up_mbit * MBIT), nat=nat, mode="honest",
                  joined_s=0.0, leaves_s=leaves_s)


# ---- network.fetch
def test_a_sender_that_leaves_mid_transfer_fails_the_fetch_and_frees_its_uplink():
    up = Uplink("na", 1 * MB)                       # 10 MB take 10 s
    got = fetch(up, 4.0, "na", 1e9, 10 * MB, 0.0, timeout_s=30.0)
    assert not got.ok and got.end_s == 4.0
    assert 0 < got.sent_bytes < 10 * MB             # what left before it went counts, the rest not
    assert up.busy_until < 4.1                      # the unsent part is given back


def test_asking_a_sender_already_gone_fails_after_a_round_trip():
    got = fetch(Uplink("na", 1 * MB), 1.0, "na", 1e9, MB, 5.0, timeout_s=30.0)
    assert not got.ok and got.sent_bytes == 0 and math.isclose(got.end_s, 5.03)


def test_a_saturated_uplink_queues_at_most_one_timeout_of_work():
    """A thousand workers ask one 20 Mbit peer for a 12.7 MB delta at once: the first few get it
    within the 30 s timeout, the rest fail at 30 s and their reservations are given back."""
    up = Uplink("na", 20 * MBIT)
    results = [fetch(up, math.inf, "na", 1e9, 12_700_000, 0.0, PEER_FETCH_TIMEOUT_S) for _ in range(1000)]
    ok = [r for r in results if r.ok]
    assert 1 <= len(ok) <= 6 and all(r.end_s <= PEER_FETCH_TIMEOUT_S for r in ok)
    assert all(r.end_s == PEER_FETCH_TIMEOUT_S for r in results if not r.ok)
    assert up.busy_until <= PEER_FETCH_TIMEOUT_S


# ---- the gossip's retry: the next holder, then the trainer
def spread(trainer: Uplink, cfg: Gossip | None = None) -> DeltaSpread:
    return DeltaSpread(cfg or Gossip(), 12_700_000, 50_000_000, 1.0, 0, lambda w, at: (trainer, math.inf))


def test_a_fetch_from_a_departed_holder_falls_back_to_the_trainer():
    trainer = Uplink("na", 1000 * MBIT)
    g = spread(trainer)
    holder = worker(1, leaves_s=2.0)                # 12.7 MB at 20 Mbit take 5 s: it leaves after 2
    me = worker(2)
    held_s, src = g._get(me, [SimHolder(holder.peer_id, "trainer", holder, 0.0)], g.delta_bytes, 0.0)
    assert src is None and math.isfinite(held_s) and held_s > 2.0
    assert g.failed == {"peer": 1, "trainer": 0}
    assert g.peer_bytes < g.delta_bytes and g.trainer_bytes == g.delta_bytes


def test_a_trainer_that_is_gone_is_retried_at_the_next_sync_poll_until_another_serves():
    """The worker's trainer dies at 10 s; it moves to another at 40 s (reconnect): the fetches in
    between fail and the version arrives from the other trainer."""
    dead, other = Uplink("na", 1000 * MBIT), Uplink("eu", 1000 * MBIT)
    g = DeltaSpread(Gossip(peer_wait_s=0.0), 12_700_000, 50_000_000, 1.0, 0,
                    lambda w, at: (dead, 10.0) if at < 40.0 else (other, math.inf))
    held_s, src = g._get(worker(2), [], g.delta_bytes, 12.0)
    assert src is None and 40.0 <= held_s < 42.0
    assert g.failed["trainer"] >= 10 and other.sent_bytes == g.delta_bytes and dead.sent_bytes == 0


def test_a_herd_on_the_first_holder_times_out_and_goes_to_the_trainer():
    """wait_rule "fixed", peer_wait_s = 30: the waiting workers all see the first holder's record and ask it (as
    CatchUp._wait_for_holder stops at the first record); those it can't serve within 30 s ask the
    trainer, so every worker holds the version and none waits for ever."""
    trainer = Uplink("na", 1000 * MBIT)
    g = spread(trainer, Gossip(peer_wait_s=30.0, wait_rule="fixed"))
    g.held[0] = {i: 0.0 for i in range(200)}
    live = [worker(i) for i in range(200)]
    s = g.publish(1, 0.0, live)
    assert len(g.held[1]) == 200 and s.failed_peer_fetches > 50
    assert s.reach_s["99"] < 30 + PEER_FETCH_TIMEOUT_S + 10


def test_a_whole_wait_spreads_the_waiting_workers_over_the_holders():
    """The same 200 workers under "fixed-whole" (the product's rule, delta_sources.waits_whole):
    each reads the records when its drawn wait ends and asks a random holder announced by then, so
    the sources are many and few fetches fail, where "fixed" sends every waiting worker to the
    first holder."""
    chosen = {}
    failed = {}
    for rule in ("fixed", "fixed-whole"):
        g = spread(Uplink("na", 1000 * MBIT), Gossip(peer_wait_s=30.0, wait_rule=rule))
        g.held[0] = {i: 0.0 for i in range(200)}
        s = g.publish(1, 0.0, [worker(i) for i in range(200)])
        assert len(g.held[1]) == 200
        chosen[rule], failed[rule] = len({w.idx for w in g.sources_chosen}), s.failed_peer_fetches
    assert chosen["fixed-whole"] > 3 * chosen["fixed"] and failed["fixed-whole"] < failed["fixed"] / 3


# ---- at most max_peer_attempts peers per update, then the trainer (protocol/delta_sources.py)
def test_ask_order_shuffles_and_keeps_at_most_limit():
    found = [SimHolder(f"p{i}", "trainer", worker(i), 0.0) for i in range(10)]
    assert len(delta_sources.ask_order(list(found), random.Random(0))) == 10
    assert len(delta_sources.ask_order(list(found), random.Random(0), 3)) == 3
    assert delta_sources.ask_order(list(found), random.Random(0), 0) == []
    firsts = {delta_sources.ask_order(list(found), random.Random(s), 1)[0].holder_id for s in range(50)}
    assert len(firsts) > 5                                   # the kept one is a random draw
    with pytest.raises(ValueError, match="limit"):
        delta_sources.ask_order(found, random.Random(0), -1)
    assert delta_sources.attempts_left(0, 7) is None
    with pytest.raises(ValueError, match="max_peer_attempts"):
        delta_sources.attempts_left(-1, 0)
    assert [delta_sources.attempts_left(2, n) for n in range(4)] == [2, 1, 0, 0]


def slow(idx: int) -> Worker:
    """A worker whose 1 Mbit downlink needs ~100 s for the 12.7 MB delta: every peer fetch times out."""
    w = worker(idx)
    w.down_bps = 1 * MBIT
    return w


@pytest.mark.parametrize(("limit", "asked"), [(1, 1), (2, 2), (3, 3), (0, 10)])
def test_the_simulated_catch_up_asks_at_most_max_peer_attempts_holders(limit, asked):
    """A worker whose downlink needs over 30 s for the delta fails with every peer (30 s each);
    after `limit` of the 10 holders (0: all of them) it asks the trainer, which has 120 s."""
    trainer = Uplink("na", 1000 * MBIT)
    holders = [SimHolder(f"p{i}", "trainer", worker(i), 0.0) for i in range(10)]
    g = spread(trainer, Gossip(max_peer_attempts=limit))
    held_s, src = g._get(slow(99), holders, g.delta_bytes, 0.0)
    assert src is None and g.failed == {"peer": asked, "trainer": 0} and g.trainer_bytes == g.delta_bytes
    assert math.isclose(held_s, asked * PEER_FETCH_TIMEOUT_S + g.delta_bytes / MBIT, abs_tol=1.0)

    g = spread(Uplink("na", 1000 * MBIT), Gossip(max_peer_attempts=limit))   # the same in a version's spread
    g.held[0] = {99: 0.0}
    g.holders[1] = list(holders)
    s = g.publish(1, 0.0, [slow(99)])
    assert s.failed_peer_fetches == asked and s.failed_trainer_fetches == 0 and s.trainer_bytes == g.delta_bytes


def test_the_scenario_default_is_the_products():
    from swarmrl.node.runtime.config import WorkerConfig

    assert Gossip().max_peer_attempts == delta_sources.MAX_PEER_ATTEMPTS
    assert WorkerConfig.model_fields["max_peer_attempts"].default == delta_sources.MAX_PEER_ATTEMPTS


# ---- the trainer-loss scenario
def test_trainer_loss_stays_bounded_and_reports_before_and_after():
    sc = load_scenario(None, {"workers": 200, "hours": 0.25, "trainers": {"count": 2, "lost_at_s": 400,
                                                                          "reconnect_s": 30}})
    s = simulate(sc, None)
    reach = s["propagation"]["reach_95_s"]
    assert reach["never"] == 0 and reach["p95"] < 300          # no version takes longer than the run
    assert s["fetches_failed"]["trainer"] > 0                  # fetches from the dead trainer failed
    assert s["uplink_queue_s_max"]["peer"] <= 2 * PEER_FETCH_TIMEOUT_S
    loss = s["trainer_loss"]
    assert loss["lost_at_s"] == 400 and loss["after"]["versions_per_hour"] > 0


# ---- the backlog rule counts open leases
def test_open_prompts_follow_issue_answer_expire_revoke_and_restore():
    book = LeaseBook("J", ttl_ms=100)
    a = book.issue("w1", 4, 0, pb.SamplingParams(), now_ms=0)
    b = book.issue("w2", 3, 0, pb.SamplingParams(), now_ms=50)
    assert book.open_prompts() == 7
    book.record_answers(a.lease_id, [0, 1])
    book.record_answers(a.lease_id, [1])                       # answered twice counts once
    assert book.open_prompts() == 5
    book.revoke([b.lease_id])
    assert book.open_prompts() == 2
    book.record_answers(b.lease_id, [4])                       # an answer to a closed lease changes nothing
    assert book.open_prompts() == 2
    assert book.expire(now_ms=101) == [a.lease_id] and book.open_prompts() == 0
    c = book.issue("w3", 2, 0, pb.SamplingParams(), now_ms=200)
    restored = LeaseBook("J", ttl_ms=100)
    restored.restore([c], admitted={c.prompt_indices[0]})
    assert restored.open_prompts() == 1


def test_backlog_full_counts_pending_groups_and_open_prompts():
    assert not backlog_full(100, 64)                           # 2 batches of 64 = 128
    assert backlog_full(128, 64)                               # the trainer's rule: pending groups only
    assert backlog_full(100, 64, open_prompts=28)              # the what-if: open leases count too
    assert not backlog_full(64, 64, open_prompts=63, batches=2)


def test_the_simulated_trainer_refuses_leases_once_open_ones_fill_the_backlog():
    job = JobShape(batch_groups=8, prompts_per_lease=4, lease_rule="pending", backlog_counts_open=True,
                   backlog_batches=2)
    t = SimTrainer(0, 1, job, Uplink("na", 1e9), Metrics(), 0.0)
    got = [t.request_lease(worker(i), 0.0, 0, False)[0] for i in range(6)]
    assert got == ["lease"] * 4 + ["busy"] * 2                 # 4 leases x 4 prompts = 2 batches of 8
    assert len(t.pending) == 0


# ---- the uplink book keeps its stretches in time order
def test_a_booking_ahead_of_the_clock_does_not_delay_an_earlier_request():
    """A retry computed ahead of the clock books 100-110 s; a request made afterwards for 0 s is
    served at once (not after 110 s), and one that does not fit before 100 s goes after 110 s."""
    up = Uplink("na", 1 * MB)                        # 10 MB take 10 s
    assert up.reserve(100.0, 10 * MB) == 110.0
    assert up.reserve(0.0, 10 * MB) == 10.0
    assert up.reserve(95.0, 10 * MB) == 120.0        # 95-105 would run into 100: after 110
    assert up.reserve(10.0, 10 * MB) == 20.0         # touches the first stretch: merged
    assert up.starts == [0.0, 100.0] and up.ends == [20.0, 120.0]
    assert up.cancel(110.0, 105.0, 10 * MB) == 5 * MB   # the 100-110 one fails at 105: 105-110 is free
    assert up.reserve(104.0, 1 * MB) == 106.0 and up.sent_bytes == 36 * MB
    up.forget_before(50.0)
    assert up.starts == [100.0, 110.0] and up.busy_until == 120.0


def test_the_scaled_wait_grows_per_doubling_of_the_previous_versions_holders():
    assert delta_sources.wait_ceiling_s(5.0, "fixed", 10_000) == 5.0
    assert [delta_sources.wait_ceiling_s(5.0, "scaled", n) for n in (0, 100, 128, 256, 1024)] == [0, 0, 0, 5, 15]
    assert [delta_sources.wait_ceiling_s(5.0, "scaled-whole", n) for n in (100, 1024)] == [0, 15]
    assert delta_sources.wait_ceiling_s(5.0, "fixed-whole", 10) == 5.0
    assert [delta_sources.waits_whole(r) for r in delta_sources.WAIT_RULES] == [False, False, True, True]
    with pytest.raises(ValueError, match="wait_rule"):
        delta_sources.waits_whole("whole")
    with pytest.raises(ValueError, match="wait_rule"):
        delta_sources.wait_ceiling_s(5.0, "longer", 10)
    with pytest.raises(ValueError, match="peer_wait_s"):
        delta_sources.wait_ceiling_s(-1.0, "scaled", 10)
    assert "gossip.wait_rule" in str(pytest.raises(ValueError, Gossip, wait_rule="longer").value)
