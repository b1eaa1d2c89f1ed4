"""A worker's per-job sync figures stay bounded over many versions and many misbehaving peers,
and still do their jobs: the newest versions' first-held times are kept, a recently dropped peer
is not asked, a peer failing three times is dropped (node/swarm/catchup.SyncStats)."""

from __future__ import annotations

from swarmrl.node.swarm.catchup import FAILURES_TO_DROP, HELD_AT_KEPT, PEERS_KEPT, SyncStats
from swarmrl.node.swarm.holders import Holder
from swarmrl.protocol.delta_sources import candidates


def _holder(peer: str) -> Holder:
    return Holder(holder_id=peer, libp2p_peer_id=b"x", payload_sha256=b"s", payload_size=1, signer="trainer")


def test_many_versions_keep_the_newest_first_held_times():
    stats = SyncStats()
    for v in range(10 * HELD_AT_KEPT):
        stats.note_held(v, 1000.0 + v)
        stats.note_held(v, 5000.0 + v)   # held again later: the first time stays
    assert len(stats.held_at) == HELD_AT_KEPT
    assert min(stats.held_at) == 9 * HELD_AT_KEPT
    assert stats.held_at[10 * HELD_AT_KEPT - 1] == 1000.0 + 10 * HELD_AT_KEPT - 1
    assert len(stats.report()["held_at"]) == HELD_AT_KEPT


def test_many_bad_peers_leave_bounded_tables_and_recent_liars_stay_dropped():
    stats = SyncStats()
    for n in range(5 * PEERS_KEPT):
        stats.drop(f"liar-{n}")
        assert not stats.failed(f"flaky-{n}")   # one failure each: counted, not dropped
    assert len(stats.dropped_peers) == PEERS_KEPT and len(stats._failures) == PEERS_KEPT
    recent = [_holder(f"liar-{5 * PEERS_KEPT - 1}"), _holder("liar-0"), _holder("honest")]
    assert [h.holder_id for h in candidates(recent, me="me", dropped=stats.dropped_peers, signers={"trainer"})] \
        == ["liar-0", "honest"]   # the oldest drop was forgotten: one more wasted fetch at worst
    # a peer failing FAILURES_TO_DROP times is dropped, with up to PEERS_KEPT - 1 others failing between
    for k in range(FAILURES_TO_DROP):
        dropped = stats.failed("stalling")
        assert dropped == (k == FAILURES_TO_DROP - 1)
        for n in range(PEERS_KEPT - 1):
            stats.failed(f"other-{k}-{n}")
    assert "stalling" in stats.dropped_peers and "stalling" not in stats._failures
    assert stats.report()["dropped_peers"] == sorted(stats.dropped_peers)
