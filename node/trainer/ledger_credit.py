"""The ledger's contribution statements (`protocol.credit`): one signed statement per job and
version, stored in the transaction that marks the version's groups trained, so a crash loses
neither (the version's groups stay pending and its statement unwritten together) and a version
never gets two statements (the (job, version) key keeps the first). `CreditTables` is a part of
`ledger.Ledger`, which supplies the connection (`_tx`, `_query`)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any

from swarmrl.protocol.credit import ConsumedGroup, model_tokens, statement_sha256
from swarmrl.protocol.pb import swarm_pb2 as pb

CONSUMED_STATES = ("dropped", "no_signal")   # group states a statement lists as dropped (with the note)


class CreditTables:
    """Signed contribution statements and the consumed groups they listed."""

    def _tx(self, *, sync: bool = True) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError   # ledger.Ledger

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError   # ledger.Ledger

    def consumed_groups(self, row_ids: Iterable[int]) -> list[ConsumedGroup]:
        """The groups with ledger ids `row_ids` as a statement credits them (batch id, signer,
        prompt index, model-sampled tokens), in id order; an id whose batch is unknown is left out.
        Read before the groups are cleared (`Ledger.compact` clears only finished batches)."""
        ids = sorted(set(row_ids))
        out: list[ConsumedGroup] = []
        for lo in range(0, len(ids), 500):
            part = ids[lo:lo + 500]
            rows = self._query(
                "SELECT g.id, b.batch_id, g.peer_id, g.prompt_index, g.grp FROM groups g JOIN batches b"
                f" ON b.seq = g.batch_seq WHERE g.id IN ({','.join('?' * len(part))}) ORDER BY g.id", tuple(part))
            out += [ConsumedGroup(b, p, int(i), model_tokens(pb.Group.FromString(g)) if g else 0) for _, b, p, i, g in rows]
        return out

    def unstated_drops(self, job_id: str) -> tuple[list[int], list[ConsumedGroup]]:
        """The job's groups consumed without credit (dropped, or in a batch without signal) that no
        statement listed yet: (their ledger ids, the groups with reason = the ledger's note, or
        the state when it has none)."""
        rows = self._query(
            "SELECT g.id, b.batch_id, g.peer_id, g.prompt_index, g.state, g.note FROM groups g"
            " JOIN batches b ON b.seq = g.batch_seq WHERE g.job_id = ? AND g.state IN (?, ?)"
            " AND NOT EXISTS (SELECT 1 FROM stated_groups s WHERE s.group_id = g.id) ORDER BY g.id",
            (job_id, *CONSUMED_STATES))
        return ([int(r[0]) for r in rows],
                [ConsumedGroup(b, p, int(i), reason=(note or state)[:200]) for _, b, p, i, state, note in rows])

    def record_statement(self, job_id: str, version: int, envelope: pb.Signed, *, trained: Iterable[int] = (),
                         listed: Iterable[int] = ()) -> pb.Signed:
        """Store the signed statement of `version` and, in the same transaction, mark the groups
        `trained` (ledger ids) trained at step `version` and the dropped ones it `listed` as
        stated. Returns the stored statement: the one given, or the one stored before for the
        same version (then nothing is marked: the first statement of a version is its only one).
        Durable before it returns (the ledger's sync)."""
        with self._tx() as db:
            cur = db.execute("INSERT OR IGNORE INTO statements VALUES (?, ?, ?, ?)",
                             (job_id, version, statement_sha256(envelope), envelope.SerializeToString()))
            if cur.rowcount != 1:
                (stored,), = db.execute("SELECT envelope FROM statements WHERE job_id = ? AND version = ?",
                                        (job_id, version)).fetchall()
                return pb.Signed.FromString(stored)
            db.executemany("UPDATE groups SET state = 'trained', step = ?, note = '' WHERE id = ?",
                           [(version, r) for r in trained])
            db.executemany("INSERT OR IGNORE INTO stated_groups VALUES (?, ?)", [(r, version) for r in listed])
        return envelope

    def drop_pending(self, job_id: str, note: str, keep: Iterable[int] = ()) -> int:
        """Drop every pending group of the job but those with ledger ids `keep` (`note`: why);
        returns how many were dropped."""
        kept = list(keep)
        with self._tx() as db:
            cur = db.execute(
                "UPDATE groups SET state = 'dropped', note = ? WHERE job_id = ? AND state = 'pending'"
                f" AND id NOT IN ({','.join('?' * len(kept))})", (note, job_id, *kept))
            return cur.rowcount

    def statements(self, job_id: str, after_version: int, limit: int) -> list[pb.Signed]:
        """Up to `limit` of the job's signed statements with a version above `after_version`, ascending."""
        return [pb.Signed.FromString(e) for (e,) in self._query(
            "SELECT envelope FROM statements WHERE job_id = ? AND version > ? ORDER BY version LIMIT ?",
            (job_id, after_version, limit))]

    def statement_by_sha256(self, job_id: str, sha256: bytes) -> pb.Signed | None:
        """The job's signed statement whose body has this sha256 (its content address), or None."""
        rows = self._query("SELECT envelope FROM statements WHERE job_id = ? AND sha256 = ?", (job_id, sha256))
        return pb.Signed.FromString(rows[0][0]) if rows else None

    def last_statement(self, job_id: str) -> pb.Signed | None:
        """The job's statement of the highest version, or None before the first."""
        rows = self._query("SELECT envelope FROM statements WHERE job_id = ? ORDER BY version DESC LIMIT 1",
                           (job_id,))
        return pb.Signed.FromString(rows[0][0]) if rows else None

    def batches_by_id(self, job_id: str, batch_ids: Iterable[str]) -> list[tuple[int, str, pb.Signed]]:
        """The job's batches among `batch_ids` (hex) that are still whole (not compacted), as
        `batches_after` returns them (seq, lease id, envelope), ascending seq."""
        wanted = list(dict.fromkeys(batch_ids))
        if not wanted:
            return []
        rows = self._query(
            "SELECT seq, lease_id, envelope FROM batches WHERE job_id = ? AND length(envelope) > 0"
            f" AND batch_id IN ({','.join('?' * len(wanted))}) ORDER BY seq", (job_id, *wanted))
        return [(int(s), lease_id, pb.Signed.FromString(e)) for s, lease_id, e in rows]
