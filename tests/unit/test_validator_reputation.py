"""Reputation store: counts, failures by check, sample-rate policy, bans and their expiry; the
first-sighting store behind the duplicate rung."""

from __future__ import annotations

from pathlib import Path

import pytest

from swarmrl.protocol.verdicts import ALL, LOGPROB, REGRADE
from swarmrl.validator import reputation as rp
from swarmrl.validator.reputation import Reputation
from swarmrl.validator.seen import SeenStore

H = 3600 * 1000
T0 = 1_700_000_000_000


def passes(rep: Reputation, peer: str, n: int, now: int = T0) -> None:
    for _ in range(n):
        rep.record(peer, passed=True, check=ALL, now_ms=now)


def test_new_peers_are_checked_fully_then_the_rate_decays_to_base() -> None:
    rep = Reputation(":memory:")
    assert rep.sample_rate("nobody", 0.25, T0) == 1.0
    passes(rep, "p", rp.NEW_PEER_CHECKS - 1)
    assert rep.sample_rate("p", 0.25, T0) == 1.0
    passes(rep, "p", 1)
    after_16 = rep.sample_rate("p", 0.25, T0)
    assert 0.25 < after_16 < 0.5
    passes(rep, "p", 200)
    after_216 = rep.sample_rate("p", 0.25, T0)
    assert 0.25 < after_216 < after_16 and after_216 < 0.27
    with pytest.raises(ValueError):
        rep.sample_rate("p", 1.5, T0)


def test_soft_flags_lower_the_score_and_raise_the_rate() -> None:
    rep = Reputation(":memory:")
    passes(rep, "clean", 40)
    passes(rep, "flaky", 30)
    for _ in range(10):
        rep.record("flaky", passed=True, check=ALL, now_ms=T0, soft_flags=1)
    clean, flaky = rep.peer("clean"), rep.peer("flaky")
    assert clean is not None and flaky is not None and flaky.score < clean.score
    assert rep.sample_rate("flaky", 0.25, T0) > rep.sample_rate("clean", 0.25, T0)


def test_a_failed_check_bans_for_a_day_then_doubles() -> None:
    rep = Reputation(":memory:")
    passes(rep, "p", 50)
    assert rep.record("p", passed=False, check=LOGPROB, now_ms=T0)
    rec = rep.peer("p")
    assert rec is not None and rec.failed == 1 and rec.failures == {LOGPROB: 1}
    assert rec.banned_until_ms == T0 + rp.BAN_MS and rec.ban_reason == "failed logprob"
    assert rep.is_banned("p", T0 + 23 * H) and rep.sample_rate("p", 0.25, T0 + 23 * H) == 1.0
    assert not rep.is_banned("p", T0 + 25 * H)                      # expired on its own
    assert rep.sample_rate("p", 0.25, T0 + 25 * H) < 1.0             # the failure is no longer recent
    assert not rep.record("p", passed=False, check=LOGPROB, now_ms=T0 + 2 * H)  # already banned then
    rep.record("p", passed=False, check=REGRADE, now_ms=T0 + 30 * H)
    rec = rep.peer("p")
    assert rec is not None and rec.bans == 2 and rec.banned_until_ms == T0 + 30 * H + 2 * rp.BAN_MS
    assert rec.failures == {LOGPROB: 2, REGRADE: 1}
    rep.lift_ban("p")
    assert not rep.is_banned("p", T0 + 31 * H)


def test_reputation_persists(tmp_path: Path) -> None:
    path = tmp_path / "rep.sqlite"
    rep = Reputation(path)
    passes(rep, "p", 3)
    rep.ban("p", "manual", T0, duration_ms=H)
    rep.close()
    again = Reputation(path)
    rec = again.peer("p")
    assert rec is not None and rec.checked == 3 and rec.banned(T0 + 1) and [r.peer_id for r in again.peers()] == ["p"]


def test_first_sightings_and_cursors(tmp_path: Path) -> None:
    seen = SeenStore(tmp_path / "seen.sqlite")
    a = seen.first_seen("k", job_id="j", prompt_index=1, peer_id="a", batch_id="ba", seq=3, now_ms=T0)
    b = seen.first_seen("k", job_id="j", prompt_index=1, peer_id="b", batch_id="bb", seq=9, now_ms=T0 + 1)
    assert a == b and (b.peer_id, b.batch_id, b.seq) == ("a", "ba", 3)
    assert seen.cursor("j", "t") == 0
    seen.set_cursor("j", "t", 5)
    seen.set_cursor("j", "t", 4)  # never moves back
    assert seen.cursor("j", "t") == 5 and seen.cursor("j", "other") == 0
