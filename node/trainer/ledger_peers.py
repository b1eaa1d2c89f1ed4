"""The per-peer tables of the trainer's ledger: rejections, validator verdicts, bans, strikes, and
the per-peer figures `swarmrl status` shows. `PeerTables` is a part of `ledger.Ledger`, which
supplies the connection (`_tx`, `_query`)."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from swarmrl.protocol.pb import swarm_pb2 as pb


class PeerTables:
    """Rejections, verdicts, bans, strikes and per-peer counts of the ledger's jobs."""

    def _tx(self, *, sync: bool = True) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError   # ledger.Ledger

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError   # ledger.Ledger

    # ---- rejections and verdicts
    def reject(self, job_id: str, peer_id: str, reason: str, now_ms: int, count: int = 1) -> None:
        """Record `count` rejections of `peer_id`'s groups (or batch) for `reason`, at unix ms `now_ms`."""
        with self._tx() as db:
            db.executemany(
                "INSERT INTO rejections (job_id, peer_id, reason, at_ms) VALUES (?,?,?,?)",
                [(job_id, peer_id, reason, now_ms)] * count,
            )

    def rejection_counts(self, job_id: str) -> Counter[str]:
        """Rejection reason -> number of rejections recorded for the job."""
        rows = self._query("SELECT reason, COUNT(*) FROM rejections WHERE job_id = ? GROUP BY reason", (job_id,))
        return Counter({r: n for r, n in rows})

    def add_verdicts(self, job_id: str, validator_id: str, verdicts: Iterable[pb.Verdict], now_ms: int) -> list[pb.Verdict]:
        """Record validator `validator_id`'s verdicts for the job at unix ms `now_ms`. Returns the
        verdicts newly recorded, in order: the only ones a caller may act on.

        A verdict the same validator already gave for the same (batch, prompt index) is ignored
        (a retried or replayed report, or a repeat inside one report), and is not returned.
        """
        new = []
        with self._tx() as db:
            for v in verdicts:
                cur = db.execute(
                    "INSERT OR IGNORE INTO verdicts (job_id, validator_id, peer_id, batch_id, prompt_index, passed,"
                    " checkname, detail, at_ms) VALUES (?,?,?,?,?,?,?,?,?)",
                    (job_id, validator_id, v.peer_id, v.batch_id, v.prompt_index, int(v.passed), v.check, v.detail,
                     now_ms))
                if cur.rowcount == 1:
                    new.append(v)
        return new

    def unseen_verdicts(self, validator_id: str, verdicts: Iterable[pb.Verdict]) -> list[pb.Verdict]:
        """The verdicts `add_verdicts` would newly record (none of the ledger's, no repeat among
        them), in order, without recording them: a caller acts on them first, then records them,
        so a crash in between leaves them unrecorded and a retry acts again."""
        new, seen = [], set()
        for v in verdicts:
            key = (v.batch_id, v.prompt_index)
            if key in seen:
                continue
            seen.add(key)
            rows = self._query("SELECT 1 FROM verdicts WHERE validator_id = ? AND batch_id = ? AND prompt_index = ?"
                               " LIMIT 1", (validator_id, v.batch_id, v.prompt_index))   # the table's unique key
            if not rows:
                new.append(v)
        return new

    def recent_verdicts(self, job_id: str, limit: int) -> list[pb.VerdictRecord]:
        """The job's newest `limit` verdicts, newest first."""
        rows = self._query(
            "SELECT validator_id, peer_id, batch_id, prompt_index, passed, checkname, detail, at_ms FROM verdicts"
            " WHERE job_id = ? ORDER BY rowid DESC LIMIT ?", (job_id, limit))
        return [pb.VerdictRecord(verdict=pb.Verdict(job_id=job_id, peer_id=p, batch_id=b, prompt_index=i, passed=bool(ok),
                                                    check=c, detail=d), validator_id=v, at_ms=t)
                for v, p, b, i, ok, c, d, t in rows]

    def verdict_counts(self, job_id: str) -> tuple[int, int]:
        """(checked, failed) verdicts for a job."""
        rows = self._query("SELECT COUNT(*), COALESCE(SUM(1 - passed), 0) FROM verdicts WHERE job_id = ?", (job_id,))
        return int(rows[0][0]), int(rows[0][1])

    # ---- bans and per-peer figures
    def add_ban(self, job_id: str, peer_id: str, reason: str, at_ms: int, until_ms: int) -> None:
        """Record (or replace) the peer's ban from the job: `reason`, unix ms `at_ms` to `until_ms`."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO bans VALUES (?, ?, ?, ?, ?)", (job_id, peer_id, reason, at_ms, until_ms))

    def remove_ban(self, job_id: str, peer_id: str) -> None:
        """Forget the peer's ban from the job (no-op if not banned)."""
        with self._tx() as db:
            db.execute("DELETE FROM bans WHERE job_id = ? AND peer_id = ?", (job_id, peer_id))

    def bans(self, job_id: str) -> list[tuple[str, str, int, int]]:
        """(peer_id, reason, at_ms, until_ms) of the job's bans."""
        return [(p, r, int(a), int(u)) for p, r, a, u in self._query(
            "SELECT peer_id, reason, at_ms, until_ms FROM bans WHERE job_id = ?", (job_id,))]

    def set_strikes(self, job_id: str, peer_id: str, count: int) -> None:
        """Record the peer's attributable admission failures (0 forgets them)."""
        with self._tx() as db:
            if count:
                db.execute("INSERT OR REPLACE INTO strikes VALUES (?, ?, ?)", (job_id, peer_id, count))
            else:
                db.execute("DELETE FROM strikes WHERE job_id = ? AND peer_id = ?", (job_id, peer_id))

    def strikes(self, job_id: str) -> dict[str, int]:
        """peer_id -> attributable admission failures recorded for the job."""
        return {p: int(n) for p, n in self._query("SELECT peer_id, count FROM strikes WHERE job_id = ?", (job_id,))}

    def _per_peer(self, sql: str, job_id: str) -> dict[str, Counter[str]]:
        """peer -> key -> count from `sql` returning (peer_id, key, count) rows for `job_id`."""
        out: dict[str, Counter[str]] = {}
        for p, key, n in self._query(sql, (job_id,)):
            out.setdefault(p, Counter())[key] = n
        return out

    def peer_state_counts(self, job_id: str) -> dict[str, Counter[str]]:
        """peer -> group state ("pending", "trained", "no_signal", "dropped") -> count (their sum: admitted)."""
        return self._per_peer(
            "SELECT peer_id, state, COUNT(*) FROM groups WHERE job_id = ? GROUP BY peer_id, state", job_id)

    def dropped_banned(self, job_id: str) -> int:
        """Admitted groups dropped because their peer was banned."""
        return int(self._query("SELECT COUNT(*) FROM groups WHERE job_id = ? AND state = 'dropped'"
                               " AND note LIKE 'banned%'", (job_id,))[0][0])

    def peer_rejections(self, job_id: str) -> dict[str, Counter[str]]:
        """peer -> rejection reason -> count."""
        return self._per_peer(
            "SELECT peer_id, reason, COUNT(*) FROM rejections WHERE job_id = ? GROUP BY peer_id, reason", job_id)

    def peer_first_seen(self, job_id: str) -> dict[str, int]:
        """peer -> unix ms of its first batch here (admitted or rejected)."""
        rows = self._query(
            "SELECT peer_id, MIN(t) FROM (SELECT peer_id, received_ms AS t FROM batches WHERE job_id = ?"
            " UNION ALL SELECT peer_id, at_ms AS t FROM rejections WHERE job_id = ?) GROUP BY peer_id", (job_id, job_id))
        return {p: int(t) for p, t in rows}

    def peer_verdict_counts(self, job_id: str) -> dict[str, tuple[int, int]]:
        """peer -> (verdicts, failed verdicts)."""
        rows = self._query("SELECT peer_id, COUNT(*), COALESCE(SUM(1 - passed), 0) FROM verdicts WHERE job_id = ?"
                           " GROUP BY peer_id", (job_id,))
        return {p: (int(n), int(f)) for p, n, f in rows}
