"""The worker's receipts: every trainer-signed batch receipt it verified (`protocol.receipts`),
kept durably in one SQLite file, and its credit per job read back from them
(`swarmrl worker --credit`).

A receipt is kept whole (the signed envelope), so the worker can show it to anyone later (an
audit, a claim that a trainer dropped its groups); the columns beside it are what the credit
table sums. One file per worker key (`receipts_path`): several workers sharing a cache folder
keep separate books. Writes are durable (synchronous=FULL): a receipt the worker counted
survives a power cut.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from swarmrl.node.runtime.sqlite import connect
from swarmrl.protocol import signing
from swarmrl.protocol.pb import swarm_pb2 as pb
from swarmrl.protocol.receipts import open_receipt

SCHEMA = """
CREATE TABLE IF NOT EXISTS receipts (
    batch_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, trainer_id TEXT NOT NULL, peer_id TEXT NOT NULL,
    admitted INTEGER NOT NULL, groups INTEGER NOT NULL, policy_version INTEGER NOT NULL,
    at_ms INTEGER NOT NULL, envelope BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS receipts_job ON receipts (job_id, at_ms);
"""


def receipts_path(cache_dir: Path, peer_id: str) -> Path:
    """Where the worker with `peer_id` keeps its receipts under its cache folder."""
    return cache_dir / "receipts" / f"{peer_id}.sqlite"


@dataclass(frozen=True)
class JobCredit:
    """One job's credit from a worker's receipts: groups admitted, groups submitted in the
    receipted batches, batches, trainers that signed, and the first and last receipt (unix ms)."""

    job_id: str
    admitted: int
    groups: int
    batches: int
    trainers: int
    first_ms: int
    last_ms: int


class ReceiptStore:
    """A worker's verified receipts in SQLite (thread-safe: the job sessions share one)."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._db = connect(path, SCHEMA, durable=True)
        self._lock = threading.Lock()

    def add(self, envelope: pb.Signed) -> bool:
        """Keep a signed receipt the caller verified (`protocol.receipts.verify_receipt`).
        Returns False when a receipt for the same batch is already kept (the first one stays).

        Raises:
            ReceiptError: the envelope's signature does not verify (nothing unverified is kept).
        """
        r, trainer = open_receipt(envelope)
        row = (r.batch_id, r.job_id, trainer, r.peer_id, len(r.admitted), r.groups, r.policy_version, r.at_ms,
               signing.canonical_bytes(envelope))
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO receipts VALUES (?,?,?,?,?,?,?,?,?)", row)
        return cur.rowcount == 1

    def receipt(self, batch_id: str) -> pb.Signed | None:
        """The kept signed receipt of `batch_id`, or None."""
        rows = self._query("SELECT envelope FROM receipts WHERE batch_id = ?", (batch_id,))
        return pb.Signed.FromString(rows[0][0]) if rows else None

    def envelopes(self, job_id: str) -> list[pb.Signed]:
        """Every kept signed receipt of the job, oldest first (for audits)."""
        return [pb.Signed.FromString(e) for (e,) in self._query(
            "SELECT envelope FROM receipts WHERE job_id = ? ORDER BY at_ms", (job_id,))]

    def credit(self) -> list[JobCredit]:
        """Credit per job from the kept receipts, the job with the latest receipt first."""
        rows = self._query(
            "SELECT job_id, SUM(admitted), SUM(groups), COUNT(*), COUNT(DISTINCT trainer_id), MIN(at_ms), MAX(at_ms)"
            " FROM receipts GROUP BY job_id ORDER BY MAX(at_ms) DESC", ())
        return [JobCredit(j, int(a), int(g), int(b), int(t), int(f), int(la)) for j, a, g, b, t, f, la in rows]

    def _query(self, sql: str, args: tuple[object, ...]) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._db.close()


def job_receipts(paths: Iterable[Path], job_id: str) -> list[pb.Signed]:
    """Every signed receipt of `job_id` kept in the receipt stores at `paths` (each opened,
    read and closed in turn), store by store.

    Raises:
        sqlite3.DatabaseError: a file that is not a receipt store.
    """
    out: list[pb.Signed] = []
    for path in paths:
        store = ReceiptStore(path)
        try:
            out += store.envelopes(job_id)
        finally:
            store.close()
    return out
