"""LeaseBook stays bounded over 100k leases (answered, partly answered, expired, revoked,
answered late) and keeps its promises: no admitted index is issued again, a closed lease stays
closed when answered again, every index is eventually admitted, a restart rebuilds the same
frontier (protocol/leases.py)."""

from __future__ import annotations

import random

from swarmrl.protocol.leases import EXPIRED_KEPT, LeaseBook
from swarmrl.protocol.pb import swarm_pb2 as pb

TTL_MS = 1_000
SAMPLING = pb.SamplingParams(n=2)


def _drive(book: LeaseBook, leases: int, seed: int = 0) -> tuple[set[int], list[dict[str, int]]]:
    """Issue `leases` leases of 2 prompts to 50 peers, 1 ms apart; answer 80% in full (half of
    them late, out of order), 8% in part, let 8% expire and revoke 4% (half of those answered
    anyway through the revoked lease, as a batch on a revoked lease can be). Returns the
    admitted indices and the book's sizes sampled every 1000 leases."""
    rng = random.Random(seed)
    admitted: set[int] = set()
    waiting: list[pb.Lease] = []   # leases answered later, in shuffled order
    sizes = []
    for n in range(leases):
        now = n
        book.expire(now)
        lease = book.issue(f"peer-{n % 50}", 2, 0, SAMPLING, now)
        assert not admitted.intersection(lease.prompt_indices), "an admitted index was issued again"
        roll = rng.random()
        if roll < 0.4:
            book.record_answers(lease.lease_id, list(lease.prompt_indices))
            admitted.update(lease.prompt_indices)
        elif roll < 0.8:
            waiting.append(lease)
        elif roll < 0.88:
            book.record_answers(lease.lease_id, [lease.prompt_indices[0]])
            admitted.add(lease.prompt_indices[0])
        elif roll < 0.92:
            assert book.revoke([lease.lease_id]) == [lease.lease_id]
            if roll < 0.90:   # a batch on the revoked lease is admitted anyway (still before its deadline)
                book.record_answers(lease.lease_id, list(lease.prompt_indices))
                admitted.update(lease.prompt_indices)
        if len(waiting) > 200 or n == leases - 1:
            rng.shuffle(waiting)
            for w in waiting:
                if book.get(w.lease_id) is not None:   # an open lease: its worker answers it in full
                    assert book.record_answers(w.lease_id, list(w.prompt_indices))
                    admitted.update(w.prompt_indices)
            waiting.clear()
        if n % 1000 == 0:
            sizes.append(book.held())
    return admitted, sizes


def test_a_hundred_thousand_leases_leave_the_book_bounded_and_exact():
    book = LeaseBook("job", ttl_ms=TTL_MS)
    admitted, sizes = _drive(book, 100_000)
    # open leases: at most those issued within the ttl (one per ms), whatever the job's length
    worst = {k: max(s[k] for s in sizes) for k in sizes[0]}
    assert worst["open"] <= TTL_MS + 1 and worst["answered"] == worst["open"]
    assert worst["deadlines"] <= TTL_MS + 1 and worst["peers"] <= 50
    assert worst["expired"] <= EXPIRED_KEPT   # the ids a late batch is told lease_expired by
    # admitted indices kept one by one: the frontier above the admitted prefix (indices of a few
    # ttl windows, those still waiting for an expired lease's re-issue), not the job's history
    assert len(admitted) > 150_000
    assert worst["admitted"] < 10 * 2 * TTL_MS
    early, late = sizes[25:50], sizes[75:]
    assert max(s["admitted"] for s in late) < 2 * max(s["admitted"] for s in early)   # no growth with length
    # run the job out: expire everything, answer what comes back; every index ends admitted once
    now = 200_000
    book.expire(now)
    while book.open_prompts() or book.held()["requeued"]:
        lease = book.issue("late", 2, 0, SAMPLING, now)
        assert not admitted.intersection(lease.prompt_indices)
        assert book.record_answers(lease.lease_id, list(lease.prompt_indices))
        admitted.update(lease.prompt_indices)
    top = book.admitted_below()
    assert book.held() == {"open": 0, "answered": 0, "admitted": 0, "requeued": 0,
                           "deadlines": book.held()["deadlines"], "peers": 0, "expired": book.held()["expired"]}
    assert admitted >= set(range(top)) and not {i for i in admitted if i >= top}.difference(range(top, top + 2))


def test_a_closed_lease_answered_again_stays_closed_and_its_indices_stay_admitted():
    book = LeaseBook("job", ttl_ms=TTL_MS)
    lease = book.issue("p", 3, 0, SAMPLING, 0)
    assert book.record_answers(lease.lease_id, list(lease.prompt_indices))
    assert book.get(lease.lease_id) is None and book.answered(lease.lease_id) == set()
    assert not book.record_answers(lease.lease_id, list(lease.prompt_indices))   # a replayed answer
    assert book.get(lease.lease_id) is None and book.held()["answered"] == 0
    assert book.admitted_below() == 3
    fresh = book.issue("p", 3, 0, SAMPLING, 1)
    assert list(fresh.prompt_indices) == [3, 4, 5]


def test_a_restart_rebuilds_the_prefix_and_the_frontier():
    book = LeaseBook("job", ttl_ms=TTL_MS, shard=(1, 3))
    leases = [book.issue("p", 2, 0, SAMPLING, 0) for _ in range(4)]   # indices 1, 4, ..., 22
    book.record_answers(leases[0].lease_id, list(leases[0].prompt_indices))   # 1, 4
    book.record_answers(leases[2].lease_id, list(leases[2].prompt_indices))   # 13, 16
    book.record_answers(leases[1].lease_id, [7])
    assert book.admitted_below() == 10 and book.held()["admitted"] == 2
    again = LeaseBook("job", ttl_ms=TTL_MS, shard=(1, 3))
    again.restore([leases[1], leases[3]], {1, 4, 7, 13, 16, 2, 5})   # 2, 5: another shard's
    assert again.admitted_below() == 10 and again.held()["admitted"] == 2
    assert again.answered(leases[1].lease_id) == {7} and again.open_prompts() == 3
    again.expire(TTL_MS + 1)
    assert sorted(again.issue("q", 3, 0, SAMPLING, TTL_MS + 1).prompt_indices) == [10, 19, 22]
