"""Peer reputation at a validator: counts, failures by check, bans, and the sample rate they set.

SQLite (stdlib), one connection serialized by a lock. Times are unix milliseconds, passed in by
the caller (tests and simulations use their own clock).

Policy (the constants below):
- score = (passed + 1) / (checked + soft_flags + 2): Laplace's rule of succession, so a new
  peer starts at 1/2 and every check, soft flag or failure moves it.
- sample rate = 1.0 for a peer with fewer than NEW_PEER_CHECKS verdicts, with a failure in the
  last RECENT_FAILURE_MS, or banned; otherwise base + (1 - base) * min(1, GAIN * (1 - score)),
  which decays toward `base` as clean checks accumulate (score 17/18 after 16 passes: ~0.42 at
  base 0.25; ~0.28 after 100 passes).
- ban: a failed banning check (verdicts.BANNING_CHECKS) bans the peer for BAN_MS (24 h); each
  further ban doubles the duration, up to MAX_BAN_MS (30 days). A ban expires on its own or is
  lifted with `lift_ban`. The validator can't refuse anyone's rollouts (trainers do, per job, on
  its verdicts): here a ban means every batch of the peer is checked on every job.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

from swarmrl.node.runtime.sqlite import connect
from swarmrl.protocol.verdicts import BANNING_CHECKS
from swarmrl.validator import policy
from swarmrl.validator.policy import BAN_MS, GAIN, MAX_BAN_MS, NEW_PEER_CHECKS, RECENT_FAILURE_MS

__all__ = ["BAN_MS", "GAIN", "MAX_BAN_MS", "NEW_PEER_CHECKS", "RECENT_FAILURE_MS", "PeerRecord", "Reputation"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS peers (
    peer_id TEXT PRIMARY KEY, checked INTEGER NOT NULL DEFAULT 0, passed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, soft_flags INTEGER NOT NULL DEFAULT 0,
    first_seen_ms INTEGER NOT NULL, last_seen_ms INTEGER NOT NULL, last_failure_ms INTEGER,
    banned_until_ms INTEGER, ban_reason TEXT NOT NULL DEFAULT '', bans INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS failures (
    peer_id TEXT NOT NULL, checkname TEXT NOT NULL, n INTEGER NOT NULL, PRIMARY KEY (peer_id, checkname));
"""


@dataclass(frozen=True)
class PeerRecord:
    """One peer's standing. `banned_until_ms` is None when never banned or lifted."""

    peer_id: str
    checked: int
    passed: int
    failed: int
    soft_flags: int
    first_seen_ms: int
    last_seen_ms: int
    last_failure_ms: int | None
    banned_until_ms: int | None
    ban_reason: str
    bans: int
    failures: dict[str, int] = field(default_factory=dict)

    @property
    def score(self) -> float:
        """(passed + 1) / (checked + soft_flags + 2), in (0, 1)."""
        return policy.score(self.passed, self.checked, self.soft_flags)

    def banned(self, now_ms: int) -> bool:
        """True while a ban runs at unix ms `now_ms` (`banned_until_ms` not yet reached)."""
        return self.banned_until_ms is not None and now_ms < self.banned_until_ms


_PEER_COLUMNS = tuple(f.name for f in fields(PeerRecord) if f.name != "failures")  # the peers table's


class Reputation:
    """Per-peer reputation store. path: the SQLite file (":memory:" for a throwaway store)."""

    def __init__(self, path: Path | str) -> None:
        self._db = connect(path, SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the database connection; the store is unusable afterwards."""
        with self._lock:
            self._db.close()

    def _touch(self, peer_id: str, now_ms: int) -> None:
        self._db.execute(
            "INSERT INTO peers (peer_id, first_seen_ms, last_seen_ms) VALUES (?, ?, ?)"
            " ON CONFLICT (peer_id) DO UPDATE SET last_seen_ms = MAX(last_seen_ms, excluded.last_seen_ms)",
            (peer_id, now_ms, now_ms),
        )

    def seen(self, peer_id: str, now_ms: int) -> None:
        """Note that the peer was active (a batch of it was read)."""
        with self._lock:
            self._touch(peer_id, now_ms)

    def record(self, peer_id: str, *, passed: bool, check: str, now_ms: int, soft_flags: int = 0) -> bool:
        """Count one verdict on the peer; a failed banning check bans it. Returns True when this
        verdict banned the peer (it was not banned before)."""
        with self._lock:
            self._touch(peer_id, now_ms)
            self._db.execute(
                "UPDATE peers SET checked = checked + 1, passed = passed + ?, failed = failed + ?,"
                " soft_flags = soft_flags + ? WHERE peer_id = ?",
                (int(passed), int(not passed), soft_flags, peer_id),
            )
            if passed:
                return False
            self._db.execute("UPDATE peers SET last_failure_ms = ? WHERE peer_id = ?", (now_ms, peer_id))
            self._db.execute(
                "INSERT INTO failures VALUES (?, ?, 1) ON CONFLICT (peer_id, checkname) DO UPDATE SET n = n + 1",
                (peer_id, check),
            )
        if check in BANNING_CHECKS and not self.is_banned(peer_id, now_ms):
            self.ban(peer_id, f"failed {check}", now_ms)
            return True
        return False

    def ban(self, peer_id: str, reason: str, now_ms: int, duration_ms: int | None = None) -> int:
        """Ban the peer until now + duration (default: BAN_MS doubled per earlier ban, capped at
        MAX_BAN_MS). Returns the ban's end (unix ms)."""
        with self._lock:
            self._touch(peer_id, now_ms)
            (bans,) = self._db.execute("SELECT bans FROM peers WHERE peer_id = ?", (peer_id,)).fetchone()
            if duration_ms is None:
                duration_ms = policy.ban_duration_ms(bans)
            until = now_ms + int(duration_ms)
            self._db.execute(
                "UPDATE peers SET banned_until_ms = ?, ban_reason = ?, bans = bans + 1 WHERE peer_id = ?",
                (until, reason[:200], peer_id),
            )
        return until

    def lift_ban(self, peer_id: str) -> None:
        """End the peer's ban now (its counts and ban history stay)."""
        with self._lock:
            self._db.execute("UPDATE peers SET banned_until_ms = NULL WHERE peer_id = ?", (peer_id,))

    def is_banned(self, peer_id: str, now_ms: int) -> bool:
        """True if the peer is known and banned at unix ms `now_ms`."""
        rec = self.peer(peer_id)
        return rec is not None and rec.banned(now_ms)

    def peer(self, peer_id: str) -> PeerRecord | None:
        """The peer's record, or None if never seen."""
        with self._lock:
            row = self._db.execute(f"SELECT {', '.join(_PEER_COLUMNS)} FROM peers WHERE peer_id = ?",
                                   (peer_id,)).fetchone()
            if row is None:
                return None
            fails = dict(self._db.execute("SELECT checkname, n FROM failures WHERE peer_id = ?", (peer_id,)).fetchall())
        return PeerRecord(**dict(zip(_PEER_COLUMNS, row, strict=True)), failures=fails)

    def peers(self) -> list[PeerRecord]:
        """Every known peer, most recently seen first."""
        with self._lock:
            ids = [p for (p,) in self._db.execute("SELECT peer_id FROM peers ORDER BY last_seen_ms DESC")]
        return [rec for p in ids if (rec := self.peer(p)) is not None]

    def sample_rate(self, peer_id: str, base: float, now_ms: int) -> float:
        """Share of the peer's groups to check fully (see the module's policy). Raises ValueError
        unless 0 <= base <= 1."""
        rec = self.peer(peer_id)
        if rec is None:
            return policy.sample_rate(base, checked=0, passed=0, soft_flags=0, banned=False, since_failure_ms=None)
        since = None if rec.last_failure_ms is None else now_ms - rec.last_failure_ms
        return policy.sample_rate(base, checked=rec.checked, passed=rec.passed, soft_flags=rec.soft_flags,
                                  banned=rec.banned(now_ms), since_failure_ms=since)
